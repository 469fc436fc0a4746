// Failures over a long run (`meridian simulate --mtbf-hours`, docs/simulator.md): what a plan's step
// time becomes in goodput when its sites fail, are detected, and the run restarts from its newest
// checkpoint (the coordinator's `on_failure: replan` / `wait` recovery, with the plan unchanged).
//
// The model, per run: each site of the plan fails independently with exponentially distributed lifetimes
// of mean mtbf (so the run sees failures at the sum of the rates); checkpoints are taken every
// `interval_steps` steps and each blocks the run for `checkpoint_seconds`; a failure loses the steps since
// the newest checkpoint and costs `detection_seconds` (the heartbeat timeout) plus `restore_seconds`
// (re-plan, re-assign, load the checkpoint, refill the pipeline). A failure during detection or restore is
// not modelled (it would only lengthen it). Steps after the last checkpoint when the run ends count.
//
// Pure functions; thread-safe.
#ifndef MERIDIAN_SIMULATOR_FAILURES_H_
#define MERIDIAN_SIMULATOR_FAILURES_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"

namespace meridian::simulator {

struct FailureModel {
  std::map<std::string, double> mtbf_seconds;  // every site of the plan, > 0 (infinity: never fails)
  double detection_seconds = 5;                // the coordinator's heartbeat_timeout_seconds default
  double restore_seconds = 0;
  double checkpoint_seconds = 0;
  int interval_steps = 50;     // job.checkpoint.interval's default
  double run_seconds = 86400;  // the wall-clock length of the run whose goodput is estimated
  int trials = 400;            // Monte Carlo runs
  uint64_t seed = 1;
};

struct FailureReport {
  double step_seconds = 0;         // the failure-free step the model was given
  double system_mtbf_seconds = 0;  // 1 / (sum of the sites' failure rates)
  double expected_failures = 0;    // in run_seconds
  // Useful training time (steps kept x step_seconds) over wall-clock time, in (0, 1]:
  double goodput = 0;      // the Monte Carlo mean over the trials
  double goodput_p10 = 0;  // its 10th percentile: one run in ten does worse
  // The same in closed form for an unbounded run: a segment of s = interval x step + checkpoint seconds
  // completes in expected (M + D + R) (e^(s / M) - 1) seconds (M the system MTBF, D + R the downtime),
  // so goodput = interval x step / that.
  double analytic_goodput = 0;
  // The interval that maximises analytic_goodput (at least 1 step), its goodput, and Young's first-order
  // sqrt(2 x checkpoint x M) in steps, beside it.
  int best_interval_steps = 0;
  double best_interval_goodput = 0;
  double young_interval_steps = 0;
};

// Errors: InvalidArgument naming the field for a non-positive step, MTBF or interval, a negative cost, no
// sites, or a run shorter than one step.
absl::StatusOr<FailureReport> SimulateFailures(double step_seconds, const FailureModel& model);

// Closed-form goodput (FailureReport::analytic_goodput) at `interval_steps`.
double AnalyticGoodput(double step_seconds, double system_mtbf_seconds, int interval_steps, double checkpoint_seconds,
                       double downtime_seconds);

}  // namespace meridian::simulator

#endif  // MERIDIAN_SIMULATOR_FAILURES_H_
