// `meridian simulate`: the discrete-event simulator (simulator/) over a plan, from files or a run
// directory. Kept out of main.cc so that CLI11 wiring stays in main and this can be tested directly.
#ifndef MERIDIAN_COORDINATOR_SIMULATE_COMMAND_H_
#define MERIDIAN_COORDINATOR_SIMULATE_COMMAND_H_

#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace meridian::coordinator {

struct SimulateCommandOptions {
  // --plan: a plan.json, or a run directory holding plan.json (and profile.json and graph.json, used
  // unless --profile / --graph say otherwise).
  std::string graph_path, profile_path, plan_path, svg_path;
  // A job spec whose `sync` section replaces the plan's (plan.json files written before it recorded one).
  std::string job_path;
  // A fleet (simulator/fleet.h, docs/scale.md): plans and simulates the pipeline, DiLoCo and DDP over it
  // instead of --plan.
  std::string fleet_path;
  // A run's metrics.jsonl: each plan site's compute per micro-batch is set to the median it measured
  // (steps after the first), its op times scaled alike (simulator::CalibrateCompute).
  std::string compute_from;
  int steps = 0;  // 0: the simulator's choice (SimulationOptions::steps)
  bool json = false;
  // Failures over a long run (simulator/failures.h), when --mtbf-hours or --site-mtbf is given: every plan
  // site's MTBF, overridden per site by SITE=HOURS entries. Negative costs mean "the default": detection
  // = the --job spec's heartbeat_timeout_seconds (else 5 s); checkpoint = the largest stage's weights and
  // optimizer state at 100 MB/s; restore = the checkpoint's cost again plus two steps (re-assign, refill);
  // interval = the --job spec's checkpoint.interval (else 50).
  double mtbf_hours = 0;
  std::vector<std::string> site_mtbf;
  double detect_seconds = -1, restore_seconds = -1, checkpoint_seconds = -1, run_hours = 24 * 7;
  int checkpoint_interval = 0;
};

// Registers the flags of `meridian simulate` on `cmd`.
void AddSimulateOptions(CLI::App* cmd, SimulateCommandOptions* options);
// Runs it: prints the summary (or JSON) to stdout and writes the SVG timeline. Returns 0, 2 for bad input
// files (named, with the field) or a plan that cannot run, 1 when the SVG cannot be written. With a
// fleet: the three systems' projections (a system that does not fit says why; still 0).
int RunSimulateCommand(const SimulateCommandOptions& options);

}  // namespace meridian::coordinator

#endif  // MERIDIAN_COORDINATOR_SIMULATE_COMMAND_H_
