// NCCL among the workers of a site of several CUDA devices (sites[].devices: [cuda:0, cuda:1, ...]), one
// rank per device: the intra-site collectives a CUDA build needs, where Debian's libtorch has no c10d
// ProcessGroupNCCL. Torch-free and CUDA-free in this header: it works on device pointers of float32.
// Built only with CUDA and NCCL (nvcc, the toolkit and nccl.h found); the executor's site group then uses
// it for float32 tensors on a worker's CUDA device (executor/site_group.h, docs/executor.md). Tested on
// GPUs by scripts/gpu_check.sh.
//
// Thread-compatible: one NcclGroup per rank, used by one thread; every collective must be entered by
// every rank in the same order. Each call waits for its result (it synchronises its stream).
#ifndef MERIDIAN_GPU_NCCL_GROUP_H_
#define MERIDIAN_GPU_NCCL_GROUP_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace meridian::gpu {

class NcclGroup {
 public:
  // Joins rank `rank` of `size` on CUDA device `device`. Rank 0 writes the group's NCCL unique id to
  // `id_file` (atomically: a temporary file renamed); the other ranks wait up to `timeout` for it.
  // Errors name the rank, the device and the NCCL or CUDA call.
  static absl::StatusOr<std::unique_ptr<NcclGroup>> Join(const std::string& id_file, int rank, int size, int device,
                                                         std::chrono::milliseconds timeout);
  ~NcclGroup();

  int rank() const { return rank_; }
  int size() const { return size_; }
  // Sums `n` floats at `data` (device memory) over the ranks, in place.
  absl::Status AllReduceSum(float* data, int64_t n);
  // Copies rank 0's `n` floats at `data` to every rank, in place.
  absl::Status Broadcast(float* data, int64_t n);
  // Every rank's `n` floats at `send` into `recv` (size() * n floats), in rank order.
  absl::Status AllGather(const float* send, float* recv, int64_t n);
  // Point to point, as the site's row scatter and gather use it: `n` floats to or from rank `peer`.
  absl::Status Send(const float* data, int64_t n, int peer);
  absl::Status Recv(float* data, int64_t n, int peer);

 private:
  struct Impl;
  NcclGroup(int rank, int size, int device);
  absl::Status Finish(const char* what, int nccl_result);

  int rank_, size_, device_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace meridian::gpu

#endif  // MERIDIAN_GPU_NCCL_GROUP_H_
