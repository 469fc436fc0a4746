// `meridian simulate`: a discrete-event simulation of what the executors do with a plan, step after step
// (docs/simulator.md). Where the planner's cost model is a formula over one step, this replays every pass,
// transfer and synchronisation in time order over shared resources:
//   - each site's compute thread runs its stage's PipelineSchedule (partitioner/schedule.h), filtered to
//     the micro-batches it owns (MicroBatchOwners), as executor/stage.cc does; a pass starts when its
//     input has arrived and also decodes that input and encodes its output (SiteProfile's
//     codec_bytes_per_second);
//   - each directed link is a FIFO at its bandwidth, a tensor arriving one latency after it has left; a
//     site with uplink_bytes_per_second > 0 also queues all its outgoing tensors on that uplink;
//   - replicas of a stage sum their gradients in buckets handed over during their last backward pass
//     (reduce-scatter to every other replica, then all-gather), as executor/replica_sync.cc does;
//   - the global gradient norm and the loss travel as control messages behind the queued tensors, from
//     the last stage's first replica to the first stage's and back to every replica; a site starts its
//     next step when it has the total;
//   - under DiLoCo (job.sync), each fragment's pseudo-gradients are exchanged every H / F steps, on the
//     same links, in 1 MiB chunks interleaved with the other traffic (the exchange's streams share the
//     peer's connection with the control messages, which wait behind the chunk in flight); with overlap
//     the stage waits for an exchange only at the next synchronisation point. The run's final
//     synchronisation is not simulated.
// Not modelled: the optimizer step and data loading (not in the profile), TCP dynamics (a link is its
// measured bandwidth), compute slowed by the site's own sends.
//
// Pure functions of their inputs; thread-safe.
#ifndef MERIDIAN_SIMULATOR_SIMULATOR_H_
#define MERIDIAN_SIMULATOR_SIMULATOR_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "partitioner/model.h"
#include "partitioner/planner.h"

namespace meridian::simulator {

struct SimulationOptions {
  // Steps simulated; 0 chooses: 3 with every-step sync, 2 H + 1 under DiLoCo (two rounds).
  int steps = 0;
  int64_t bucket_bytes = 4 << 20;        // replica gradient buckets (executor's default)
  double gradient_bytes_fraction = 0.5;  // float32 gradient bytes = this * op param_bytes (as the planner)
  int64_t chunk_bytes = 1 << 20;         // DiLoCo exchanges share links in chunks of this size
};

// One interval of the timeline.
struct Activity {
  std::string site;
  // "forward", "backward" (compute thread, codec work included), "recompute" (a recomputing stage's
  // forward pass again, before its backward pass), "optimizer" (clipping and the optimizer step, once a
  // step after the norm: SiteProfile::optimizer_seconds_per_byte), "send" (an activation or gradient on
  // the site's outgoing link), "sync" (replica gradient buckets), "outer_sync" (DiLoCo pseudo-gradients),
  // "control" (gradient-norm messages), "wait" (the stage waiting for a synchronisation to finish).
  std::string kind;
  int step = 0;
  int micro_batch = -1;  // forward, backward, recompute and send; -1 otherwise
  std::string peer;      // send, sync, outer_sync, control: the receiving site
  double start = 0, end = 0;
};

struct SiteReport {
  std::string site;
  int stage = 0, replica = 0;
  // Over the last simulated step: compute-thread seconds (passes and codec work), seconds its stage
  // waited (idle between its step's start and end), seconds its outgoing links were busy, codec seconds.
  double compute_seconds = 0, wait_seconds = 0, send_seconds = 0, codec_seconds = 0;
  int micro_batches = 0;
};

struct LinkReport {
  std::string from, to;
  double bytes = 0;          // over the last simulated step
  double busy_fraction = 0;  // of the last simulated step
};

struct SimulationResult {
  double step_seconds = 0;  // mean step after the first (includes DiLoCo rounds when simulated)
  // The planner's steady-state formula (docs/cost-model.md) for the same layout and profile, its codecs
  // chosen from the plan's own: what the analytic model predicts, beside the simulation. 0 when the
  // planner cannot evaluate the layout (its message is in notes).
  double analytic_step_seconds = 0;
  double median_step_seconds = 0;    // over the steps after the first
  double last_step_seconds = 0;      // the last simulated step (the one reported per site and link)
  std::vector<double> step_times;    // every simulated step, the first included
  double compute_bound_seconds = 0;  // M micro-batches over every profiled site's whole-model rate
  double utilisation = 0;            // compute_bound_seconds / step_seconds
  double bubble_fraction = 0;        // share of the last step the plan's sites' compute threads were idle
  std::vector<SiteReport> sites;
  std::vector<LinkReport> links;
  std::vector<Activity> timeline;  // the last simulated step, relative to its start
  std::vector<std::string> notes;  // what the inputs left out (codec costs, sync model)
};

// Simulates `plan` (its stages, sites, micro-batch shares, in-flight depths, link codecs and replica sync,
// `plan.sync` included) over `graph` and `profile`. Errors: InvalidArgument naming the stage, site, link or
// op that the profile or graph lacks (a site without a link to its neighbour, an unknown codec name).
absl::StatusOr<SimulationResult> Simulate(const partitioner::OpGraph& graph, const partitioner::ClusterProfile& profile,
                                          const partitioner::Plan& plan, const SimulationOptions& options = {});

// `profile` with each plan site's compute scaled so that its stage's forward and backward passes take
// `seconds_per_micro_batch[site]` (e.g. what a run measured, metrics.jsonl): every op time of the site
// (op_seconds, else FLOPs over flops_per_second) is scaled by one factor. Sites not named keep their times.
// InvalidArgument for a site the plan does not use or a non-positive time.
absl::StatusOr<partitioner::ClusterProfile> CalibrateCompute(
    const partitioner::OpGraph& graph, const partitioner::ClusterProfile& profile, const partitioner::Plan& plan,
    const std::map<std::string, double>& seconds_per_micro_batch);

// A whole plan read back from its JSON (`meridian plan --json`, a run's plan.json): stages with sites,
// op ranges, micro-batch shares, in-flight depths and gradient codecs; links with codecs and ratios; the
// replica sync. Checked against `graph` and `profile`; errors name `path` and the field.
absl::StatusOr<partitioner::Plan> ParsePlanJson(const std::string& text, const std::string& path,
                                                const partitioner::OpGraph& graph,
                                                const partitioner::ClusterProfile& profile);

// The result as one JSON object: step_seconds, median_step_seconds, utilisation, bubble_fraction,
// compute_bound_seconds, step_times, links [{from, to, bytes, busy_fraction}], stages [{stage, sites:
// [{site, replica, micro_batches, compute_seconds, wait_seconds, send_seconds, codec_seconds}]}], timeline
// [{site, kind, start, end, micro_batch (forward, backward, send), peer (sends)}] of the last step, notes.
std::string SimulationJson(const SimulationResult& result);

// A Gantt chart (SVG) of the last simulated step: one row per site, one colour per activity kind, compute
// in the upper band of a row and its outgoing traffic in the lower one.
std::string TimelineSvg(const SimulationResult& result);

// A human-readable summary: step, utilisation, bubble, then per stage and per link.
std::string SimulationTable(const SimulationResult& result);

}  // namespace meridian::simulator

#endif  // MERIDIAN_SIMULATOR_SIMULATOR_H_
