// NCCL among the workers of a site of several CUDA devices (sites[].devices: [cuda:0, cuda:1, ...]), one
// rank per device: the intra-site collectives a CUDA build needs, where Debian's libtorch has no c10d
// ProcessGroupNCCL. Torch-free and CUDA-free in this header: it works on device pointers of float32.
// Built only with CUDA and NCCL (nvcc, the toolkit and nccl.h found); the executor's site group then uses
// it for float32 tensors on a worker's CUDA device (executor/site_group.h, docs/executor.md). Tested on
// GPUs by scripts/gpu_check.sh.
//
// Thread-compatible: one NcclGroup per rank, used by one thread (Abort excepted); every collective must be
// entered by every rank in the same order. Each call waits for its result on the group's own stream,
// which does not synchronise with the device's other streams: give a StreamMark for data computed there.
#ifndef MERIDIAN_GPU_NCCL_GROUP_H_
#define MERIDIAN_GPU_NCCL_GROUP_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace meridian::gpu {

// The work queued so far on a CUDA device's legacy default stream (libtorch's current stream, unless a
// stream guard names another), as a CUDA event: a collective given the mark starts on the device after
// that work, while the stream goes on with what is queued later. Immutable once recorded; thread-safe.
class StreamMark {
 public:
  // Records the mark on `device`'s default stream, from the calling thread (whose current device it sets).
  static absl::StatusOr<std::shared_ptr<const StreamMark>> Record(int device);
  ~StreamMark();

 private:
  friend class NcclGroup;
  struct Impl;
  StreamMark();
  std::unique_ptr<Impl> impl_;
};

class NcclGroup {
 public:
  // Joins rank `rank` of `size` on CUDA device `device`. Rank 0 writes the group's NCCL unique id to
  // `id_file` (atomically: a temporary file renamed); the other ranks wait up to `timeout` for it, and
  // for the group to form. The communicator is non-blocking, so the same timeout bounds each call
  // afterwards, its connection to the other ranks included: one not done by then aborts the group.
  // Errors name the rank, the device and the NCCL or CUDA call.
  static absl::StatusOr<std::unique_ptr<NcclGroup>> Join(const std::string& id_file, int rank, int size, int device,
                                                         std::chrono::milliseconds timeout);
  ~NcclGroup();

  int rank() const { return rank_; }
  int size() const { return size_; }
  // Each collective starts after `after`'s work when given, and returns once its result is in place.
  // Sums `n` floats at `data` (device memory) over the ranks, in place.
  absl::Status AllReduceSum(float* data, int64_t n, const StreamMark* after = nullptr);
  // Copies rank 0's `n` floats at `data` to every rank, in place.
  absl::Status Broadcast(float* data, int64_t n, const StreamMark* after = nullptr);
  // Every rank's `n` floats at `send` into `recv` (size() * n floats), in rank order.
  absl::Status AllGather(const float* send, float* recv, int64_t n, const StreamMark* after = nullptr);
  // Point to point, as the site's row scatter and gather use it: `n` floats to or from rank `peer`.
  absl::Status Send(const float* data, int64_t n, int peer, const StreamMark* after = nullptr);
  absl::Status Recv(float* data, int64_t n, int peer, const StreamMark* after = nullptr);
  // Thread-safe, from any thread: the call now waiting (for a rank that never comes) aborts the
  // communicator and fails at its next poll (within a millisecond), and so does every later call; the
  // destructor then aborts rather than destroys. ncclCommAbort itself may wait for the other ranks of the
  // process's NCCL proxy to let go (NVIDIA/nccl#863): a worker's death, which ends its site, ends that.
  void Abort();

 private:
  struct Impl;
  NcclGroup(int rank, int size, int device, std::chrono::milliseconds timeout);
  // Before a collective: the group still usable, the device current, the stream after `after`.
  absl::Status Begin(const char* what, const StreamMark* after);
  // After it: waits for the call (ncclInProgress) and then its stream, until the group's timeout.
  absl::Status Finish(const char* what, int nccl_result);
  // Waits for a call that returned `nccl_result` to be done, and with `stream` for its kernels too; polled,
  // so that `until` or Abort ends the wait (the group then aborted).
  absl::Status Wait(const char* what, int nccl_result, std::chrono::steady_clock::time_point until, bool stream);
  // Aborts the communicator (a failed one is fit for nothing else) and returns `error`.
  absl::Status Fail(absl::Status error);
  std::string Who() const;

  int rank_, size_, device_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace meridian::gpu

#endif  // MERIDIAN_GPU_NCCL_GROUP_H_
