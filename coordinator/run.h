// `meridian run CLUSTER.yaml [JOB.yaml]`: starts the coordinator, prints each site's join command, waits
// for the executors, has them measure their devices, the model and every link, plans, sends each its
// stage, and reports progress until the job ends. Exit 0 when training finished, 1 on a failure (a site
// lost, a stage failed), 2 on invalid input. (The CLI then exports and, for instruction data, scores
// held-out exact match before and after: model_tools::AfterRun, RUN/eval.json.)
#ifndef MERIDIAN_COORDINATOR_RUN_H_
#define MERIDIAN_COORDINATOR_RUN_H_

#include <string>

#include "absl/status/status.h"

namespace CLI {
class App;
}

namespace meridian::coordinator {

struct RunOptions {
  std::string cluster_path, job_path, run_dir = "runs/meridian";
  int steps = 0;
  double join_timeout_seconds = 0;    // 0: wait for the sites indefinitely
  int micro_batches = 0;              // 0: the job's
  std::string export_dir;             // non-empty: consolidated HF export after training
  int profile_repeats = 5;            // timed passes per op in the sites' model measurement
  double probe_seconds = 1.0;         // what each link's bulk probe aims to take, each way
  std::string split = "planned";      // "even": sites in spec order, equal op counts (ablation)
  std::string plan_path;              // non-empty: train this plan.json's layout (sites, replicas, cuts)
  std::string profile_path;           // non-empty: plan from this profile.json (or run directory's), measuring nothing
  bool resume = false;                // stages start from the newest intact checkpoint
  int eval_examples = 200;            // JSONL jobs: held-out examples scored before, per checkpoint, after (0: none)
  std::string launch;                 // "ssh": start the executors of the sites with ssh: (docs/launch.md)
  bool accept_new_host_keys = false;  // --launch ssh: record unknown host keys on first contact
};

void AddRunOptions(CLI::App* cmd, RunOptions* options);
int Run(const RunOptions& options);

}  // namespace meridian::coordinator

#endif  // MERIDIAN_COORDINATOR_RUN_H_
