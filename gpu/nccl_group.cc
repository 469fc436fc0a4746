#include "gpu/nccl_group.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <thread>

#include "absl/strings/str_cat.h"

namespace meridian::gpu {

struct NcclGroup::Impl {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
};

NcclGroup::NcclGroup(int rank, int size, int device)
    : rank_(rank), size_(size), device_(device), impl_(std::make_unique<Impl>()) {}

NcclGroup::~NcclGroup() {
  if (impl_->comm) ncclCommDestroy(impl_->comm);
  if (impl_->stream) cudaStreamDestroy(impl_->stream);
}

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
  std::unique_ptr<NcclGroup> g(new NcclGroup(rank, size, device));
  if (cudaError_t e = cudaStreamCreate(&g->impl_->stream); e != cudaSuccess)
    return absl::InternalError(absl::StrCat(who, ": cudaStreamCreate: ", cudaGetErrorString(e)));
  if (ncclResult_t r = ncclCommInitRank(&g->impl_->comm, size, id, rank); r != ncclSuccess)
    return absl::InternalError(absl::StrCat(who, ": ncclCommInitRank: ", ncclGetErrorString(r)));
  return g;
}

absl::Status NcclGroup::Finish(const char* what, int nccl_result) {
  const std::string who = absl::StrCat("NCCL rank ", rank_, " of ", size_, " on cuda:", device_);
  if (nccl_result != ncclSuccess)
    return absl::InternalError(
        absl::StrCat(who, ": ", what, ": ", ncclGetErrorString(static_cast<ncclResult_t>(nccl_result))));
  if (cudaError_t e = cudaStreamSynchronize(impl_->stream); e != cudaSuccess)
    return absl::InternalError(absl::StrCat(who, ": ", what, ": cudaStreamSynchronize: ", cudaGetErrorString(e)));
  return absl::OkStatus();
}

absl::Status NcclGroup::AllReduceSum(float* data, int64_t n) {
  return Finish("ncclAllReduce", ncclAllReduce(data, data, n, ncclFloat32, ncclSum, impl_->comm, impl_->stream));
}

absl::Status NcclGroup::Broadcast(float* data, int64_t n) {
  return Finish("ncclBroadcast", ncclBroadcast(data, data, n, ncclFloat32, 0, impl_->comm, impl_->stream));
}

absl::Status NcclGroup::AllGather(const float* send, float* recv, int64_t n) {
  return Finish("ncclAllGather", ncclAllGather(send, recv, n, ncclFloat32, impl_->comm, impl_->stream));
}

absl::Status NcclGroup::Send(const float* data, int64_t n, int peer) {
  return Finish("ncclSend", ncclSend(data, n, ncclFloat32, peer, impl_->comm, impl_->stream));
}

absl::Status NcclGroup::Recv(float* data, int64_t n, int peer) {
  return Finish("ncclRecv", ncclRecv(data, n, ncclFloat32, peer, impl_->comm, impl_->stream));
}

}  // namespace meridian::gpu
