// One stage's life, the same in static mode (`meridian-executor --assignment`) and under a coordinator
// (executor/agent.h): resume when asked, connect to the peers, run the steps with their checkpoints,
// finish. What differs between the modes -- where a checkpoint comes from, what a finished step or
// checkpoint is reported to -- comes in as StageRun's hooks. Runs on the calling thread, which must own
// the worker; the hooks run on it too.
#ifndef MERIDIAN_EXECUTOR_RUN_STAGE_H_
#define MERIDIAN_EXECUTOR_RUN_STAGE_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "executor/checkpoint.h"
#include "executor/stage.h"

namespace meridian::executor {

// The sites a stage's peer service admits while it runs `assignment` at `self`: the neighbouring stages'
// sites (every replica of each) and this stage's other replicas. The one rule for both modes.
std::set<std::string> StagePeers(const StageAssignment& assignment, const std::string& self);

struct StepDone {
  int64_t step = 0;            // 0-based
  std::optional<double> loss;  // on the first and last stages
  double seconds = 0;          // the whole step, wall clock
};

struct StageRun {
  int64_t steps = 0;        // run until this many steps are done
  int64_t total_steps = 0;  // the job's: the learning-rate schedule spans it whatever this run covers
  // Resuming: the checkpoint to start from (the stage restores it and starts at its step); empty: start
  // afresh at step 0.
  std::function<absl::StatusOr<Checkpoint>()> resume;
  // After resuming from a directory the stages write themselves (shared or local): stage 0's writer
  // removes the steps above the one loaded from `checkpoint_dir`, so an abandoned attempt's cannot mix in.
  bool forget_checkpoints_after_resume = false;
  // Checkpoints: every `checkpoint_interval` steps (0: none) the stage's shard goes to `checkpoint_dir`;
  // with `checkpoint_keep` > 0 stage 0's writer keeps that many complete steps there.
  std::string checkpoint_dir;
  int checkpoint_interval = 0, checkpoint_keep = 0;
  std::function<void(const StepDone&)> on_step;             // after every step
  std::function<absl::Status(int64_t step)> on_checkpoint;  // after this stage wrote step `step`'s shard
  std::function<absl::Status()> before_finish;              // e.g. wait for uploads
  // A step boundary (a switch to another plan) and the step lease (executor/step_control.h): called after
  // every step but the last with the steps done, it may wait (for the coordinator's lease) and returns
  // the boundary S > 0 or 0 for none. Once exactly S steps are done (S < steps), DiLoCo replicas
  // synchronise every fragment (StageWorker::SynchroniseAtBoundary), the stage saves its checkpoint of step
  // S (once, also when the interval falls there), calls on_checkpoint, and ends there. A boundary
  // already passed (heard of too late, which the lease rules out) ends the stage with FailedPrecondition
  // ("missed the step boundary S"): its neighbours may have ended there, and the coordinator then
  // resumes every stage from the newest intact checkpoint. An error (the attempt was abandoned) ends the
  // stage with it. Unset: no boundary, no lease.
  std::function<absl::StatusOr<int64_t>(int64_t steps_done)> end_after;
  // DiLoCo workers of a one-stage plan whose replica stopped answering ask this whether the coordinator
  // left that site out (StageWorker::set_left_out), waiting at most left_out_wait for it to say so.
  std::function<std::set<std::string>()> left_out;
  std::chrono::milliseconds left_out_wait{0};
};

struct StageRunResult {
  int64_t steps_done = 0;    // the steps this stage completed (resumed ones included)
  absl::Status status;       // the first failure, naming the stage, peer or file
  bool at_boundary = false;  // it ended at end_after's step, not at the last one
};

StageRunResult RunStage(StageWorker& worker, const StageRun& run);

}  // namespace meridian::executor

#endif  // MERIDIAN_EXECUTOR_RUN_STAGE_H_
