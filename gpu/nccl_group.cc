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

struct StreamMark::Impl {
  cudaEvent_t event = nullptr;
};

StreamMark::StreamMark() : impl_(std::make_unique<Impl>()) {}

StreamMark::~StreamMark() {
  if (impl_->event) cudaEventDestroy(impl_->event);
}

absl::StatusOr<std::shared_ptr<const StreamMark>> StreamMark::Record(int device) {
  const std::string who = absl::StrCat("cuda:", device);
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
    return absl::FailedPreconditionError(absl::StrCat(who, ": cudaSetDevice: ", cudaGetErrorString(e)));
  std::shared_ptr<StreamMark> mark(new StreamMark());
  if (cudaError_t e = cudaEventCreateWithFlags(&mark->impl_->event, cudaEventDisableTiming); e != cudaSuccess)
    return absl::InternalError(absl::StrCat(who, ": cudaEventCreateWithFlags: ", cudaGetErrorString(e)));
  if (cudaError_t e = cudaEventRecord(mark->impl_->event, /*legacy default stream*/ 0); e != cudaSuccess)
    return absl::InternalError(absl::StrCat(who, ": cudaEventRecord: ", cudaGetErrorString(e)));
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

std::string NcclGroup::Who() const { return absl::StrCat("NCCL rank ", rank_, " of ", size_, " on cuda:", device_); }

void NcclGroup::Abort() { impl_->abort.store(true); }

absl::StatusOr<std::unique_ptr<NcclGroup>> NcclGroup::Join(const std::string& id_file, int rank, int size, int device,
                                                           std::chrono::milliseconds timeout) {
  const std::string who = absl::StrCat("NCCL rank ", rank, " of ", size, " on cuda:", device);
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
  if (ncclResult_t r = ncclCommInitRank(&g->impl_->comm, size, id, rank); r != ncclSuccess)
    return absl::InternalError(absl::StrCat(who, ": ncclCommInitRank: ", ncclGetErrorString(r)));
  return g;
}

absl::Status NcclGroup::Begin(const char* what, const StreamMark* after) {
  if (!impl_->comm)
    return absl::FailedPreconditionError(absl::StrCat(Who(), ": ", what, ": the group was aborted earlier"));
  if (impl_->abort.load()) {
    ncclCommAbort(impl_->comm);
    impl_->comm = nullptr;
    return absl::AbortedError(absl::StrCat(Who(), ": ", what, ": the group was aborted"));
  }
  if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess)
    return absl::InternalError(absl::StrCat(Who(), ": ", what, ": cudaSetDevice: ", cudaGetErrorString(e)));
  if (after)
    if (cudaError_t e = cudaStreamWaitEvent(impl_->stream, after->impl_->event, 0); e != cudaSuccess)
      return absl::InternalError(absl::StrCat(Who(), ": ", what, ": cudaStreamWaitEvent: ", cudaGetErrorString(e)));
  return absl::OkStatus();
}

absl::Status NcclGroup::Finish(const char* what, int nccl_result) {
  if (nccl_result != ncclSuccess)
    return absl::InternalError(
        absl::StrCat(Who(), ": ", what, ": ", ncclGetErrorString(static_cast<ncclResult_t>(nccl_result))));
  // Polled rather than cudaStreamSynchronize: a rank that never comes would hold that for ever.
  const auto until = std::chrono::steady_clock::now() + timeout_;
  for (;;) {
    const cudaError_t e = cudaStreamQuery(impl_->stream);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady)
      return absl::InternalError(absl::StrCat(Who(), ": ", what, ": cudaStreamQuery: ", cudaGetErrorString(e)));
    ncclResult_t async = ncclSuccess;
    const bool failed =
        ncclCommGetAsyncError(impl_->comm, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress;
    const bool late = std::chrono::steady_clock::now() >= until;
    if (failed || late || impl_->abort.load()) {
      ncclCommAbort(impl_->comm);  // ends the kernels waiting for the other ranks
      impl_->comm = nullptr;
      if (failed) return absl::InternalError(absl::StrCat(Who(), ": ", what, ": ", ncclGetErrorString(async)));
      if (late)
        return absl::DeadlineExceededError(absl::StrCat(Who(), ": ", what,
                                                        ": the other ranks did not take part within ", timeout_.count(),
                                                        " ms; the group is aborted"));
      return absl::AbortedError(absl::StrCat(Who(), ": ", what, ": the group was aborted"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
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
