#include "gpu/nccl_group.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <thread>

#include "absl/strings/str_cat.h"

namespace meridian::gpu {
namespace {
// How errors name a rank.
std::string Describe(int rank, int size, int device) {
  return absl::StrCat("NCCL rank ", rank, " of ", size, " on cuda:", device);
}
}  // namespace

struct StreamMark::Impl {
  cudaEvent_t event = nullptr;
};

StreamMark::StreamMark() : impl_(std::make_unique<Impl>()) {}

StreamMark::~StreamMark() {
  if (impl_->event) cudaEventDestroy(impl_->event);
}

absl::StatusOr<std::shared_ptr<const StreamMark>> StreamMark::Record(int device) {
  const std::string who = absl::StrCat("cuda:", device);
  int current = -1;
  cudaGetDevice(&current);  // the caller's, restored below
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
    return absl::FailedPreconditionError(absl::StrCat(who, ": cudaSetDevice: ", cudaGetErrorString(e)));
  std::shared_ptr<StreamMark> mark(new StreamMark());
  cudaError_t e = cudaEventCreateWithFlags(&mark->impl_->event, cudaEventDisableTiming);
  const char* call = "cudaEventCreateWithFlags";
  if (e == cudaSuccess) {
    e = cudaEventRecord(mark->impl_->event, cudaStreamLegacy);
    call = "cudaEventRecord";
  }
  if (current >= 0 && current != device) cudaSetDevice(current);
  if (e != cudaSuccess) return absl::InternalError(absl::StrCat(who, ": ", call, ": ", cudaGetErrorString(e)));
  return std::shared_ptr<const StreamMark>(std::move(mark));
}

struct NcclGroup::Impl {
  ncclComm_t comm = nullptr;  // null once aborted
  cudaStream_t stream = nullptr;
  std::atomic<bool> abort{false};  // Abort() asked
};

NcclGroup::NcclGroup(int rank, int size, int device, std::chrono::milliseconds timeout)
    : rank_(rank), size_(size), device_(device), timeout_(timeout), impl_(std::make_unique<Impl>()) {}

NcclGroup::~NcclGroup() {
  // Destroying may wait for the other ranks; after Abort they may never come.
  if (impl_->comm) (impl_->abort.load() ? ncclCommAbort : ncclCommDestroy)(impl_->comm);
  if (impl_->stream) cudaStreamDestroy(impl_->stream);
}

std::string NcclGroup::Who() const { return Describe(rank_, size_, device_); }

void NcclGroup::Abort() { impl_->abort.store(true); }

absl::StatusOr<std::unique_ptr<NcclGroup>> NcclGroup::Join(const std::string& id_file, int rank, int size, int device,
                                                           std::chrono::milliseconds timeout) {
  const std::string who = Describe(rank, size, device);
  if (rank < 0 || rank >= size) return absl::InvalidArgumentError(absl::StrCat(who, ": no such rank"));
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
    return absl::FailedPreconditionError(absl::StrCat(who, ": cudaSetDevice: ", cudaGetErrorString(e)));
  ncclUniqueId id;
  if (rank == 0) {
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess)
      return absl::InternalError(absl::StrCat(who, ": ncclGetUniqueId: ", ncclGetErrorString(r)));
    const std::string tmp = absl::StrCat(id_file, ".tmp.", ::getpid());
    {
      std::ofstream out(tmp, std::ios::binary);
      out.write(id.internal, sizeof id.internal);
      if (!out) return absl::InternalError(absl::StrCat(who, ": cannot write ", tmp));
    }
    if (std::rename(tmp.c_str(), id_file.c_str()) != 0)
      return absl::InternalError(absl::StrCat(who, ": cannot rename ", tmp, " to ", id_file));
  } else {
    const auto until = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      std::ifstream in(id_file, std::ios::binary);
      std::string bytes((std::istreambuf_iterator<char>(in)), {});
      if (bytes.size() == sizeof id.internal) {
        std::copy(bytes.begin(), bytes.end(), id.internal);
        break;
      }
      if (std::chrono::steady_clock::now() >= until)
        return absl::DeadlineExceededError(absl::StrCat(who, ": rank 0 wrote no NCCL id to ", id_file));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  std::unique_ptr<NcclGroup> g(new NcclGroup(rank, size, device, timeout));
  // Non-blocking: no implicit synchronisation with the default stream, on which libtorch computes (a sum
  // waiting for another rank would hold its kernels); StreamMark orders what must be ordered.
  if (cudaError_t e = cudaStreamCreateWithFlags(&g->impl_->stream, cudaStreamNonBlocking); e != cudaSuccess)
    return absl::InternalError(absl::StrCat(who, ": cudaStreamCreateWithFlags: ", cudaGetErrorString(e)));
  // Non-blocking: a call that waits for the other ranks (this one, a first send to a peer, a first
  // collective's connections) returns ncclInProgress, and Wait bounds it, where a blocking communicator
  // would wait inside NCCL for ever.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const auto until = std::chrono::steady_clock::now() + timeout;
  if (absl::Status s = g->Wait("ncclCommInitRankConfig",
                               ncclCommInitRankConfig(&g->impl_->comm, size, id, rank, &config), until, false);
      !s.ok())
    return s;
  return g;
}

absl::Status NcclGroup::Begin(const char* what, const StreamMark* after) {
  if (!impl_->comm)
    return absl::FailedPreconditionError(absl::StrCat(Who(), ": ", what, ": the group was aborted earlier"));
  if (impl_->abort.load()) return Fail(absl::AbortedError(absl::StrCat(Who(), ": ", what, ": the group was aborted")));
  if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess)
    return Fail(absl::InternalError(absl::StrCat(Who(), ": ", what, ": cudaSetDevice: ", cudaGetErrorString(e))));
  if (after)
    if (cudaError_t e = cudaStreamWaitEvent(impl_->stream, after->impl_->event, 0); e != cudaSuccess)
      return Fail(
          absl::InternalError(absl::StrCat(Who(), ": ", what, ": cudaStreamWaitEvent: ", cudaGetErrorString(e))));
  return absl::OkStatus();
}

absl::Status NcclGroup::Fail(absl::Status error) {
  // A communicator that returned an error is fit only for abort (NCCL's rule); it ends the kernels and
  // connections still waiting for the other ranks.
  if (impl_->comm) ncclCommAbort(impl_->comm);
  impl_->comm = nullptr;
  return error;
}

absl::Status NcclGroup::Wait(const char* what, int nccl_result, std::chrono::steady_clock::time_point until,
                             bool stream) {
  // Polled, never a blocking wait: a rank that never comes would hold one for ever. First the call itself
  // (ncclInProgress while it connects to the other ranks), then, for a collective, its kernels on the stream.
  // The poll spins for about 100 us, then backs off to 1 ms: a sum of a few MiB over NVLink takes tens of us.
  const auto start = std::chrono::steady_clock::now();
  auto pause = [&] {
    const auto waited = std::chrono::steady_clock::now() - start;
    if (waited < std::chrono::microseconds(100)) return;
    std::this_thread::sleep_for(
        std::min<std::chrono::steady_clock::duration>(waited / 8, std::chrono::milliseconds(1)));
  };
  auto late = [&]() -> absl::Status {
    if (impl_->abort.load())
      return Fail(absl::AbortedError(absl::StrCat(Who(), ": ", what, ": the group was aborted")));
    if (std::chrono::steady_clock::now() >= until)
      return Fail(
          absl::DeadlineExceededError(absl::StrCat(Who(), ": ", what, ": the other ranks did not take part within ",
                                                   timeout_.count(), " ms; the group is aborted")));
    return absl::OkStatus();
  };
  ncclResult_t r = static_cast<ncclResult_t>(nccl_result);
  while (r == ncclInProgress) {
    if (absl::Status s = late(); !s.ok()) return s;
    pause();
    if (ncclResult_t q = ncclCommGetAsyncError(impl_->comm, &r); q != ncclSuccess) r = q;
  }
  if (r != ncclSuccess) return Fail(absl::InternalError(absl::StrCat(Who(), ": ", what, ": ", ncclGetErrorString(r))));
  if (!stream) return absl::OkStatus();
  for (;;) {
    const cudaError_t e = cudaStreamQuery(impl_->stream);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady)
      return Fail(absl::InternalError(absl::StrCat(Who(), ": ", what, ": cudaStreamQuery: ", cudaGetErrorString(e))));
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(impl_->comm, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress)
      return Fail(absl::InternalError(absl::StrCat(Who(), ": ", what, ": ", ncclGetErrorString(async))));
    if (absl::Status s = late(); !s.ok()) return s;
    pause();
  }
}

absl::Status NcclGroup::Finish(const char* what, int nccl_result) {
  return Wait(what, nccl_result, std::chrono::steady_clock::now() + timeout_, true);
}

absl::Status NcclGroup::AllReduceSum(float* data, int64_t n, const StreamMark* after) {
  if (absl::Status s = Begin("ncclAllReduce", after); !s.ok()) return s;
  return Finish("ncclAllReduce", ncclAllReduce(data, data, n, ncclFloat32, ncclSum, impl_->comm, impl_->stream));
}

absl::Status NcclGroup::Broadcast(float* data, int64_t n, const StreamMark* after) {
  if (absl::Status s = Begin("ncclBroadcast", after); !s.ok()) return s;
  return Finish("ncclBroadcast", ncclBroadcast(data, data, n, ncclFloat32, 0, impl_->comm, impl_->stream));
}

absl::Status NcclGroup::AllGather(const float* send, float* recv, int64_t n, const StreamMark* after) {
  if (absl::Status s = Begin("ncclAllGather", after); !s.ok()) return s;
  return Finish("ncclAllGather", ncclAllGather(send, recv, n, ncclFloat32, impl_->comm, impl_->stream));
}

absl::Status NcclGroup::Send(const float* data, int64_t n, int peer, const StreamMark* after) {
  if (absl::Status s = Begin("ncclSend", after); !s.ok()) return s;
  return Finish("ncclSend", ncclSend(data, n, ncclFloat32, peer, impl_->comm, impl_->stream));
}

absl::Status NcclGroup::Recv(float* data, int64_t n, int peer, const StreamMark* after) {
  if (absl::Status s = Begin("ncclRecv", after); !s.ok()) return s;
  return Finish("ncclRecv", ncclRecv(data, n, ncclFloat32, peer, impl_->comm, impl_->stream));
}

}  // namespace meridian::gpu
