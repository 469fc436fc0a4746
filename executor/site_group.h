// A site of several devices (`sites[].devices` in the cluster spec): one worker process per device, as
// torchrun starts them, joined in a torch c10d process group -- Gloo, the backend of Debian's CPU libtorch --
// over a c10d::FileStore in the site's scratch directory. Meridian uses c10d inside a site and its own mTLS
// streams between sites. On CUDA devices, in a build with NCCL (gpu/nccl_group.h: Debian's libtorch has no
// c10d ProcessGroupNCCL), the workers form an NCCL group beside it, one rank per device, and the
// collectives on float32 CUDA tensors go through NCCL, device to device; everything else through Gloo.
//
// Worker 0 is the executor that joined the coordinator: it alone holds the site's identity and streams to
// the other sites. Workers 1..K-1 are its child processes (WorkerPool), started for each stage it is
// assigned and for each profile, and compute only. Every worker runs the stage's schedule in lock step,
// each on its rows of every micro-batch (SiteGroup::Rows): worker 0 scatters what arrives from the
// neighbouring sites and gathers what leaves. docs/executor.md ("Sites with several devices") says why.
//
// Thread-safety: a SiteGroup is used by its stage's thread only (SiteReducer's hooks run on autograd's
// thread, which on CPU is that same thread and on a GPU autograd's device thread while the stage's thread
// waits in backward()); every collective must be entered by every worker in the same order. Under NCCL the
// order is load-bearing beyond Gloo's: the NCCL calls of a worker run in the order started, the gradient
// buckets' sums among them, so every worker must start its buckets in the same order (the same slice and
// schedule on every worker give that). A WorkerPool is thread-compatible; its monitor thread only reaps and reports.
#ifndef MERIDIAN_EXECUTOR_SITE_GROUP_H_
#define MERIDIAN_EXECUTOR_SITE_GROUP_H_

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "absl/status/statusor.h"
#include "executor/gradient_hooks.h"

namespace meridian::executor {

class SiteGroup {
 public:
  // Joins worker `rank` of `size`, on `device` ("cpu" or "cuda:N", as sites[].devices spells it), to the
  // group whose store file is `store_path` (fresh for each group: a FileStore left by an earlier group
  // would mix the two). Waits up to `timeout` for every worker; the same timeout bounds each Gloo
  // collective afterwards. `where` names the site in errors ("site 'b'").
  // On a CUDA device in a build with NCCL, every worker must be on a CUDA device of its own (the spec lists
  // each once): they also join an NCCL group, its unique id passed through a file beside `store_path`
  // named by worker 0's random number, which it broadcasts through Gloo. `timeout` bounds NCCL's calls
  // too (gpu/nccl_group.h: one not done by then aborts the group). Without NCCL in the build, CUDA tensors
  // go through Gloo via host memory (a warning says so).
  static absl::StatusOr<std::unique_ptr<SiteGroup>> Join(const std::string& store_path, int rank, int size,
                                                         std::chrono::milliseconds timeout, std::string where,
                                                         const std::string& device = "cpu");
  ~SiteGroup();

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& where() const { return where_; }
  // Whether float32 tensors on this worker's CUDA device go through NCCL.
  bool uses_nccl() const;
  // Where the bulk collectives (Scatter's and Gather's rows, gradient buckets, AllGather) want their
  // tensors and return them: this worker's CUDA device under NCCL, else the CPU.
  torch::Device collective_device() const;

  // The rows [first, first + count) of a micro-batch of `rows` rows that worker `worker` computes: equal
  // shares, the first rows % size workers one more.
  std::pair<int64_t, int64_t> Rows(int64_t rows, int worker) const;
  // Worker 0 passes the whole tensor (dimension 0: `rows`), the others an undefined one; every worker gets
  // its rows (float32, contiguous, on collective_device()).
  absl::StatusOr<torch::Tensor> Scatter(const torch::Tensor& whole, const std::vector<int64_t>& whole_shape);
  // Every worker passes its rows; worker 0 gets the whole tensor of `whole_shape` (float32, on
  // collective_device()), the others an undefined one.
  absl::StatusOr<torch::Tensor> Gather(const torch::Tensor& mine, const std::vector<int64_t>& whole_shape);
  // Sums `t` (contiguous; NCCL's when float32 on the CUDA device, else Gloo's) over the workers, in place.
  absl::Status AllReduce(torch::Tensor& t);
  // Copies worker 0's `t` (contiguous, the same shape everywhere; NCCL's as AllReduce) to every worker, in
  // place.
  absl::Status Broadcast(torch::Tensor& t);
  // Copies worker 0's `tensors` (each the same shape on every worker; any device) into every worker's, in
  // place, as one float32 broadcast: NCCL's when they are all on the worker's CUDA device, else Gloo's.
  absl::Status BroadcastInPlace(const std::vector<torch::Tensor>& tensors);
  // Every worker passes `mine` (float32, the same numel everywhere); every worker gets the workers' tensors
  // concatenated in rank order, where `mine` is: NCCL's on the worker's CUDA device, else Gloo's on the host.
  absl::StatusOr<torch::Tensor> AllGather(const torch::Tensor& mine);
  // The asynchronous sum SiteReducer starts from autograd's hooks (of `t`, contiguous, which must outlive
  // Wait); Wait() returns its outcome. Under NCCL the sums run in the order started, on a thread of the
  // group's, while the caller goes on.
  class PendingSum {
   public:
    absl::Status Wait();

   private:
    friend class SiteGroup;
    std::function<absl::Status()> wait_;
  };
  PendingSum StartAllReduce(torch::Tensor t);

 private:
  struct Impl;  // the c10d process group, and the NCCL group where there is one
  SiteGroup(int rank, int size, std::string where);
  // Runs `fn`, its exception an Unavailable error naming the site, the worker, `what` and `backend`.
  absl::Status Guard(const char* what, const std::function<void()>& fn, const char* backend = "c10d/Gloo");

  int rank_, size_;
  std::string where_;
  std::unique_ptr<Impl> impl_;
};

// The bucketed sum of a stage's gradients over the site's workers, as the cross-site replica sync does it
// (executor/replica_sync.h): buckets of about `bucket_bytes` in reverse parameter order; during the
// worker's last backward pass of the step autograd hooks copy each parameter's final gradient into its
// bucket, and a full bucket's all-reduce starts at once, while the pass goes on. Every worker runs the same
// slice on the same schedule, so buckets complete -- and their collectives start -- in the same order on all.
class SiteReducer {
 public:
  SiteReducer(SiteGroup* group, std::vector<std::pair<std::string, torch::Tensor>> params, int64_t bucket_bytes);
  ~SiteReducer();
  // The next backward pass is this worker's last in the step.
  void CaptureNextBackward();
  // Starts the buckets not started yet (a parameter without a gradient contributes zeros), waits for every
  // sum and sets each parameter's .grad to it. Returns the seconds spent waiting.
  absl::StatusOr<double> Finish();
  int buckets() const { return static_cast<int>(buckets_.size()); }
  // Buckets whose sum started while the backward pass still ran, in the last step.
  int started_during_backward() const { return during_backward_; }

 private:
  struct Bucket {
    std::vector<int> params;
    torch::Tensor data;
    int pending = 0;
    bool started = false;
    SiteGroup::PendingSum sum;
  };
  void OnGradient(int param, const torch::Tensor& grad);
  void Capture(int param, const torch::Tensor& final_grad);
  void Start(int bucket);

  SiteGroup* group_;
  std::vector<std::pair<std::string, torch::Tensor>> params_;
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_;
  std::vector<int64_t> offset_of_;
  std::vector<bool> captured_;
  bool capturing_ = false;
  int during_backward_ = 0;
  std::unique_ptr<GradientHooks> hooks_;  // last: its callbacks use everything above
};

// Workers 1..K-1 of a site, started by worker 0 (the executor) as children running this same executable
// with `args` plus `--site-worker R/K` and `--site-device DEVICE` (devices[R]). A child that dies by a
// signal or exits with an error, unless Stop() killed it, is the site's loss -- found by the monitor within
// tens of milliseconds, or by Stop() itself when the stage failed first because of it: the pool logs which
// worker and how, kills the others and ends this process with exit code 3, so its heartbeats stop and the
// coordinator recovers as for any lost site (docs/executor.md).
class WorkerPool {
 public:
  static absl::StatusOr<std::unique_ptr<WorkerPool>> Start(const std::vector<std::string>& args,
                                                           const std::vector<std::string>& devices, std::string where);
  // Waits up to `grace` for the children to exit on their own (they have finished their part), then kills
  // the ones still running. Idempotent. Destroy the pool before the site's SiteGroup: a group closed
  // under a running worker makes it fail, which would read as a death.
  void Stop(std::chrono::milliseconds grace);
  ~WorkerPool();  // Stop(1 s): see site_group.cc

 private:
  WorkerPool() = default;
  void Monitor();
  bool ReapLocked(size_t i);
  std::string where_;
  std::vector<pid_t> pids_;  // index r - 1: worker r
  std::mutex mu_;            // guards the two below
  std::vector<bool> exited_, killed_;
  std::thread monitor_;
};

// The command line's `--site-worker R/K`: R in 1..K-1, K >= 2. InvalidArgument naming the flag otherwise.
absl::StatusOr<std::pair<int, int>> ParseSiteWorker(const std::string& text);

}  // namespace meridian::executor

#endif  // MERIDIAN_EXECUTOR_SITE_GROUP_H_
