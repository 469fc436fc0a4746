// `meridian plan` and `meridian graph`: the partitioner's command-line front ends.
// Kept out of main.cc so that CLI11 wiring stays in main and these can be tested directly.
#ifndef MERIDIAN_COORDINATOR_PLAN_COMMAND_H_
#define MERIDIAN_COORDINATOR_PLAN_COMMAND_H_

#include <string>

namespace CLI {
class App;
}

namespace meridian::coordinator {

struct PlanCommandOptions {
  std::string graph_path, profile_path, dot_path;
  int micro_batches = 8;
  double ratio = 1.0;
  bool ratio_given = false;
  bool reference = false;
  bool json = false;
  bool no_replication = false;
  bool no_recompute = false;  // PlanOptions::recompute off
  bool force_heuristic = false;
  int zero = 0;                 // --zero: job.optimizer.zero for sites of several workers
  int step_overlap = 0;         // --step-overlap: job.step_overlap
  double revisit_fraction = 0;  // > 0: AQ-SGD's int4-delta on the adaptive menu (DefaultLinkCodecs)
  // > 0: the planner's K best candidate layouts, each planned as a fixed layout and simulated
  // (simulator/), ranked by simulated step; says when that ranking differs from the planner's.
  int simulate = 0;
  // --live: plan over a running coordinator's measured profile and graph instead of files.
  bool live = false;
  std::string coordinator, certs_dir, identity = "coordinator";
};

// Registers the flags of `meridian plan` on `cmd`.
void AddPlanOptions(CLI::App* cmd, PlanCommandOptions* options);
// Runs it: prints the table (or JSON) to stdout. Returns 0, 1 when a live coordinator cannot be reached,
// or 2 for bad input files or no feasible plan.
int RunPlanCommand(const PlanCommandOptions& options);

struct GraphCommandOptions {
  std::string config_path, out_path;
  int micro_batch_size = 1;
  int sequence_length = 2048;
};
void AddGraphOptions(CLI::App* cmd, GraphCommandOptions* options);
// Writes the operator graph of the LLaMA-architecture model in an HF config.json. Returns 0 or 2.
int RunGraphCommand(const GraphCommandOptions& options);

}  // namespace meridian::coordinator

#endif  // MERIDIAN_COORDINATOR_PLAN_COMMAND_H_
