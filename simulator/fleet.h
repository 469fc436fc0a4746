// Fleets: Meridian projected onto real GPU fleets (`meridian simulate --fleet FLEET.yaml`,
// docs/scale.md). A fleet names a LLaMA-architecture model, site groups (a GPU type from a device profile,
// GPUs per site, how many such sites, a region) and a link bandwidth; link latencies come from presets by
// region pair. From it come a graph (bf16 weights, gradients and activations, AdamW in fp32), a profile
// (each site one pool of its GPUs at peak bf16 FLOP/s times the device's MFU assumption) and three plans,
// each simulated (simulator.h):
//   - "pipeline": the planner's plan with replicas, deep pipelines and adaptive compression (the heuristic
//     beyond 8 sites), replicas summing gradients every step;
//   - "diloco": the same with job.sync diloco (the fleet's inner_steps and codec);
//   - "ddp": every site trains the whole model and all of them sum gradients every step (data parallelism
//     with an all-reduce); infeasible when the model and its optimizer state do not fit one site.
// Codec ratios are priced per float32 byte (compression::PayloadRatio); on the fleet's bf16 tensors they
// are doubled (an int8 activation is about half a bf16 one).
// Thread-safe (no shared state).
#ifndef MERIDIAN_SIMULATOR_FLEET_H_
#define MERIDIAN_SIMULATOR_FLEET_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "partitioner/model.h"
#include "partitioner/planner.h"
#include "simulator/simulator.h"

namespace meridian::simulator {

// A device profile (examples/profiles/gpus/NAME.json): published figures and an assumption.
struct GpuProfile {
  std::string name;
  double peak_bf16_flops_per_second = 0;  // dense, from the vendor's datasheet
  double mfu = 0.4;                       // the share of peak a training step reaches (an assumption)
  double memory_bytes = 0;
  std::string comment;  // sources
};

struct Fleet {
  std::string name;
  partitioner::OpGraph graph;
  partitioner::ClusterProfile profile;  // one site per fleet site; links between every pair
  int micro_batches = 64;
  int tokens_per_micro_batch = 0;  // micro_batch_size x sequence_length
  partitioner::SyncModel diloco;   // the "diloco" system's sync
  std::vector<std::string> notes;  // how the profile was built (GPU types, presets)
};

// Reads a fleet file (format in docs/scale.md). Device profiles and link presets come from the `gpus`
// directory it names (relative to the file). Errors name the file and the field.
absl::StatusOr<Fleet> LoadFleet(const std::string& path);

struct SystemProjection {
  std::string system;     // "pipeline", "diloco", "ddp"
  bool feasible = false;  // false: `why` says what does not fit
  std::string why;
  std::string layout;       // stages and replicas, e.g. "4 stages x 16 replicas"
  double step_seconds = 0;  // simulated
  double analytic_step_seconds = 0;
  double tokens_per_second = 0;
  double utilisation = 0;                         // of the fleet's compute bound
  double plan_seconds = 0, simulate_seconds = 0;  // wall time of planning and simulating here
};

// Plans and simulates the three systems over `fleet`.
std::vector<SystemProjection> ProjectFleet(const Fleet& fleet, const SimulationOptions& options = {});

// A table (or one JSON object: {"fleet", "sites", "compute_bound_seconds", "systems": [...]}).
std::string ProjectionTable(const Fleet& fleet, const std::vector<SystemProjection>& systems);
std::string ProjectionJson(const Fleet& fleet, const std::vector<SystemProjection>& systems);

}  // namespace meridian::simulator

#endif  // MERIDIAN_SIMULATOR_FLEET_H_
