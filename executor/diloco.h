// DiLoCo-style outer synchronisation of a replicated stage (job.sync.mode: diloco; docs/sync.md).
//
// Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models" (2023), and
// Streaming DiLoCo (2025) for the fragments. Instead of summing gradients every step, each replica of a
// stage runs its inner optimizer on its own micro-batches, and every H inner steps the replicas
//   1. compute their pseudo-gradient, delta_i = outer - local, weighted by their share of the step's
//      micro-batches (w_i = m_i / M, so the weights sum to 1);
//   2. sum the weighted pseudo-gradients with the replica gradient averager (executor/replica_sync.h):
//      reduce-scatter + all-gather, compressed with job.sync.codec and error feedback per peer, every
//      replica ending with the same bits;
//   3. step the outer parameters with the outer optimizer (Nesterov momentum or SGD) and set every
//      replica's parameters to them.
// With F fragments, the stage's parameters are cut into F contiguous groups of about equal size, and
// fragment f is synchronised after inner step t (1-based) when t is a multiple of H / F and
// (t / (H / F)) mod F == f: one fragment every H / F steps, each every H steps
// (partitioner::FragmentDueAfter, which the simulator asks too).
//
// Inner steps scale this replica's gradient by M / m_i, so that each inner step is a full step on its own
// micro-batches; with H = 1, inner SGD, outer SGD at lr 1 without momentum and the identity codec this
// equals every-step gradient averaging (a test).
//
// With `overlap` the exchange of a fragment runs on a thread of its own while the inner steps go on, and
// is applied at the next synchronisation point (H / F inner steps later), keeping the local progress made
// meanwhile: parameters = new outer parameters + (parameters now - parameters when the exchange began).
// The stage waits only when an exchange has not finished by then. After the run's last inner step Finish
// completes what is pending and synchronises every fragment once more without overlap, so every replica
// ends with the same weights.
//
// The exchange works on buffers of its own (CPU float32), never on the parameters' .grad, and uses
// streams of its own; the stage's thread keeps its streams for activations and control messages.
// Thread-compatible: the public methods are called by the stage's thread only.
#ifndef MERIDIAN_EXECUTOR_DILOCO_H_
#define MERIDIAN_EXECUTOR_DILOCO_H_

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <chrono>
#include <functional>

#include <torch/torch.h>

#include "absl/status/status.h"
#include "core/cluster_spec.h"
#include "executor/replica_sync.h"

namespace meridian::executor {

// Parameter indices of each of `fragments` contiguous groups of about equal total size (`numels` in the
// model's order); every group holds at least one parameter when there are enough.
std::vector<std::vector<int>> SplitFragments(const std::vector<int64_t>& numels, int fragments);

// One outer optimizer step: `outer` -= lr * update, with `momentum` (same shape) updated in place:
// sgd: m = mu m + delta, update = m; nesterov: m = mu m + delta, update = delta + mu m; sparseloco:
// update = delta, `momentum` untouched (the replicas' decayed error-feedback residuals are its momentum).
void OuterStep(const core::SyncSpec& spec, const torch::Tensor& delta, torch::Tensor& momentum, torch::Tensor& outer);

class OuterSync {
 public:
  // `params`: the stage's trained parameters in the model's order (their current values become the outer
  // parameters until ImportState says otherwise). `weight`: this replica's share of the micro-batches.
  OuterSync(core::SyncSpec spec, double weight, std::vector<std::pair<std::string, torch::Tensor>> params);

  ~OuterSync();  // waits for an exchange in flight (its averager gives up within a second once aborted)

  // The exchange buffers of each fragment (named after the parameters; leaf tensors whose .grad carries
  // the pseudo-gradient in and the sum out), for building one averager each over them; then Attach the
  // averagers in the same order. Synchronisation fails with FailedPrecondition before Attach. Residuals
  // restored by ImportRoundState go into the averagers here, and a resumed exchange to be run again
  // begins here; their errors are Attach's (the averagers stay attached).
  const std::vector<std::vector<std::pair<std::string, torch::Tensor>>>& buffers() const { return buffers_; }
  absl::Status Attach(std::vector<std::unique_ptr<GradientAverager>> averagers);

  // After inner step `step` (0-based) has been applied to the parameters: synchronises the fragment due,
  // if any (with overlap: applies the exchange in flight, then starts this one). Errors are the
  // averager's (naming the stage, replica and bucket).
  absl::Status AfterInnerStep(int64_t step);
  // After the run's last inner step `step`: completes what is in flight, then synchronises every fragment
  // without overlap, so that every replica ends with the outer parameters.
  absl::Status Finish(int64_t step);
  // At a plan switch's step boundary, after inner step `step` and its AfterInnerStep, on every replica of
  // the stage: as Finish, so that every replica leaves the boundary with the outer parameters, which hold
  // what each replica's codec sent of its progress in the round (with a lossy codec, error feedback keeps
  // the rest in its residuals, which a plan of another layout starts empty), and a plan of any layout
  // resumes from them. Its exchanges are numbered after step + 1's,
  // which the attempt never runs, so none reuses the number of one AfterInnerStep(step) began. A no-op
  // once suspended (a replica was lost: each keeps its own progress, as Suspend says).
  absl::Status FinishAtBoundary(int64_t step);
  // The inner step after which Finish or FinishAtBoundary last synchronised every fragment; -1 for none.
  // When it is the last inner step taken, every replica holds the outer parameters.
  int64_t synchronised_after() const { return synchronised_after_; }
  // Gives up the exchange in flight, if any (cancelled and joined), and makes AfterInnerStep and Finish
  // no-ops from now on: a replica was lost and the attempt ends at a switch (the parameters keep this
  // replica's progress; the outer state stays that of the last synchronisation applied).
  void Suspend();
  bool suspended() const { return suspended_; }
  // Polled (every 20 ms) while an exchange is awaited; once it returns true the exchange is cancelled
  // (its partners may have given it up: a lost replica) and the wait returns Cancelled. Unset: none.
  void set_cancel_check(std::function<bool()> check) { cancel_check_ = std::move(check); }
  // Seconds the last AfterInnerStep or Finish waited for an exchange.
  double last_wait_seconds() const { return last_wait_seconds_; }

  // Checkpoint state: "outer.param.<name>" and "outer.momentum.<name>" for every parameter.
  std::map<std::string, torch::Tensor> ExportState() const;
  // Restores what ExportState wrote, after the parameters were restored; a parameter missing from `state`
  // takes its current value as outer parameter and zero momentum. A shape mismatch is DataLoss naming the
  // tensor, and nothing is restored then.
  absl::Status ImportState(const std::map<std::string, torch::Tensor>& state);
  // The checkpoint names ExportState uses for parameter `name`.
  static std::vector<std::string> StateNames(const std::string& name);

  // This replica's state within the round, beside ExportState, for an exact resume mid-round (the
  // replica's round state file, core/run_layout.h): "outer.round" (float64: the fragment in flight or -1,
  // the inner step it began after, its drift squared, wire and raw bytes, seconds so far) and, for an
  // exchange in flight (overlap), that fragment's parameters' "outer.snapshot.NAME" (this replica's values
  // when it began). The exchange itself:
  //  - `await_exchange` false: runs on, not waited for; the round state holds no sum, and a replica that
  //    resumes from it runs the exchange again from its snapshot (so must every replica of the stage: they
  //    all saved at the same step, under the same rule). The stage keeps computing while it checkpoints.
  //  - true (and always for an exchange not overlapped): awaited (polling the cancel check as Complete
  //    does) without applying it, and "outer.sum.NAME" (the replicas' summed pseudo-gradient) saved too.
  //    An exchange that failed or was cancelled is then the error.
  // Beside them, with a lossy codec and error feedback, "outer.residual.NAME" for every parameter: this
  // replica's residuals (GradientAverager::ExportResiduals; under SparseLoCo they are its outer momentum),
  // for the exchange to be run again those it began with. So the resumed exchange computes the same
  // pseudo-gradient from the same snapshot, outer parameters and residuals: the same sum as the first run.
  absl::StatusOr<std::map<std::string, torch::Tensor>> ExportRoundState(bool await_exchange);
  // Restores what ExportRoundState wrote, after ImportState: the exchange in flight then is applied at the
  // synchronisation point it was due at, as if it had never stopped; without its sum it begins again at
  // Attach, as the other replicas' do. The residuals go into the averagers at Attach (at once when
  // attached already); a round state without them (a lossless codec, an older checkpoint) leaves the
  // averagers' as they are. Refused (DataLoss naming the tensor, nothing restored) when it does not fit:
  // another fragment count, a tensor missing or of another shape, sums or residuals for only some of the
  // parameters. (When the averagers are attached already, the residuals go in last, fragment by fragment;
  // having been checked here, they are refused only during an exchange, which a restore never meets.)
  absl::Status ImportRoundState(const std::map<std::string, torch::Tensor>& state);
  // After an ImportRoundState without the sum, until Attach: the fragment and the inner step (0-based) of
  // the exchange to run again; nullopt otherwise.
  std::optional<std::pair<int, int64_t>> exchange_to_run_again() const {
    if (!run_again_) return std::nullopt;
    return std::make_pair(pending_, pending_step_);
  }

  // The last synchronisation applied: its fragment, the inner step after which it began, wire bytes,
  // seconds from its start to its application, and the drift (this replica's unweighted pseudo-gradient
  // norm over the fragment).
  struct LastSync {
    int fragment = -1;
    int64_t step = -1;
    int64_t wire_bytes = 0, raw_bytes = 0;
    double seconds = 0, drift = 0;
  };
  const LastSync& last_sync() const { return last_; }
  int64_t wire_bytes() const { return wire_bytes_; }
  int64_t raw_bytes() const { return raw_bytes_; }
  // How many exchanges have been applied to the parameters so far (by this object).
  int64_t applied() const { return applied_; }

 private:
  // The number an exchange of fragment f begun after inner step `step` gives its frames, the same on every
  // replica: each exchange of an attempt has its own, since a frame of a key already waiting in the peer's
  // inbox would replace it (a replica through with fragment 0 sends fragment 1's bucket 0 while the other
  // may not yet have taken fragment 0's, which under sparse_sum nothing orders).
  int64_t ExchangeNumber(int64_t step, int f) const;
  // Loads fragment f's weighted pseudo-gradient into its buffers' .grad (snapshotting the parameters
  // with overlap), and runs the exchange numbered `number` (on the caller's thread or a new one).
  void Begin(int f, int64_t step, bool overlap, int64_t number);
  // Resumed (run_again_): begins the pending exchange again, overlapped, from the restored snapshots.
  // FailedPrecondition before Attach.
  absl::Status BeginAgain();
  // Fragment f's buffers' .grad: (outer - local[k]) * weight for its k-th parameter; sets drift2_.
  void LoadPseudoGradient(int f, const std::vector<torch::Tensor>& local);
  // Runs fragment f's exchange, counting its averager's bytes from now.
  void StartExchange(int f, int64_t step, bool overlap, int64_t number);
  // Finish and FinishAtBoundary: completes what is in flight, then exchanges every fragment without
  // overlap, numbered as begun after inner step `numbered_after`.
  absl::Status SynchroniseAll(int64_t step, int64_t numbered_after);
  // "outer.residual.NAME" of every fragment's averager into `out` (before Attach: those restored); for the
  // pending fragment, when `in_flight_runs_again`, those its exchange began with.
  absl::Status ExportResiduals(bool in_flight_runs_again, std::map<std::string, torch::Tensor>* out);
  // Moves restored_residuals_ into the attached averagers.
  absl::Status ImportResiduals();
  // Waits for the exchange begun for fragment `pending_` and applies it; no-op when none is in flight.
  absl::Status Complete();
  // Waits for the exchange thread, if any, cancelling it once the cancel check says so; adds the wait to
  // last_wait_seconds_. Its result is then in exchange_status_.
  void AwaitExchange();
  // Fragment f's averager's wire and raw bytes so far; {0, 0} before Attach.
  std::pair<int64_t, int64_t> AveragerBytes(int f) const;
  void Exchange(int f, int64_t number);  // BeginStep + Finish of fragment f's averager; sets exchange_status_

  core::SyncSpec spec_;
  double weight_;
  std::vector<std::pair<std::string, torch::Tensor>> params_;
  std::vector<torch::Tensor> outer_, momentum_;  // per parameter, on the parameter's device
  std::vector<torch::Tensor> snapshot_;          // overlap: per parameter, its value when its exchange began
  std::vector<std::vector<int>> fragments_;      // parameter indices per fragment
  std::vector<std::vector<std::pair<std::string, torch::Tensor>>> buffers_;  // per fragment, per parameter
  std::vector<std::unique_ptr<GradientAverager>> averagers_;
  int pending_ = -1;           // the fragment whose exchange is in flight (overlap), -1 for none
  int64_t pending_step_ = -1;  // the inner step after which it began
  std::thread exchange_;
  absl::Status exchange_status_;               // written by the exchange thread, read after joining it
  std::atomic<bool> cancelled_{false};         // set by the destructor: an exchange not yet begun is not begun
  std::atomic<bool> cancel_requested_{false};  // Complete or Suspend gave up the exchange in flight
  double drift2_ = 0;                          // of the exchange in flight
  std::chrono::steady_clock::time_point began_;
  LastSync last_;
  int64_t wire_bytes_at_begin_ = 0, raw_bytes_at_begin_ = 0;  // the pending fragment's averager's counters
  double last_wait_seconds_ = 0;
  bool suspended_ = false;
  int64_t synchronised_after_ = -1;
  int64_t applied_ = 0;
  std::function<bool()> cancel_check_;
  std::atomic<bool> exchange_done_{true};  // set by the exchange thread when it ends
  bool pending_overlapped_ = false;        // the pending exchange keeps the local progress made meanwhile
  bool run_again_ = false;                 // resumed without its sum: pending_'s exchange not yet begun again
  // Overlapped: the pending fragment's averager's residuals when its exchange began, by parameter name.
  std::map<std::string, torch::Tensor> pending_residuals_;
  absl::Status pending_residuals_status_;  // taking them failed: a round state that needs them fails
  bool sum_restored_ = false;              // pending_'s sum came from ImportRoundState (no exchange runs)
  std::map<std::string, torch::Tensor> restored_residuals_;  // by ImportRoundState, until Attach
  int64_t wire_bytes_ = 0, raw_bytes_ = 0;
};

}  // namespace meridian::executor

#endif  // MERIDIAN_EXECUTOR_DILOCO_H_
