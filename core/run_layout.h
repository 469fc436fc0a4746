// The layout of a run directory and of a checkpoint directory: the one place that builds and parses
// their paths. Everything else (the executors writing checkpoints, the coordinator's file store and its
// service's path check, the model tools) goes through these functions. Pure and thread-safe.
//
//   RUN/profile.json, graph.json, plan.json   what `meridian run` measured and planned
//   RUN/metrics.jsonl, eval.json              one line per step; held-out exact match
//   RUN/events.jsonl                          one line per event: joins, plans, losses, checkpoints
//   RUN/sites/<site>.log                      the coordinator's log of each site
//   RUN/weights/stage-K.safetensors           each stage's final parameters
//   RUN/checkpoints/step-S/stage-K.safetensors, stage-K.json
//                                             job.checkpoint.store: coordinator (the same step-S layout
//                                             under job.checkpoint.dir with store: shared)
//   RUN/checkpoints/step-S/stage-K.replica-R.safetensors, stage-K.replica-R.json
//                                             DiLoCo: replica R of stage K's state within its round
//                                             (executor/diloco.h; docs/sync.md)
#ifndef MERIDIAN_CORE_RUN_LAYOUT_H_
#define MERIDIAN_CORE_RUN_LAYOUT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace meridian::core {

// Files of a run directory, relative to it.
inline constexpr char kProfileFile[] = "profile.json";
inline constexpr char kGraphFile[] = "graph.json";
inline constexpr char kPlanFile[] = "plan.json";
inline constexpr char kMetricsFile[] = "metrics.jsonl";
inline constexpr char kEvalFile[] = "eval.json";
inline constexpr char kEventsFile[] = "events.jsonl";
inline constexpr char kSiteLogDir[] = "sites";
inline constexpr char kWeightsDir[] = "weights";
inline constexpr char kCheckpointsDir[] = "checkpoints";

// "step-S": the directory of checkpoint step S (S completed steps, S >= 1).
std::string StepDirName(int64_t step);
// S of a canonical "step-S" name ("step-7", not "step-007", "step-0" or "step-7x"); nullopt otherwise.
std::optional<int64_t> ParseStepDirName(std::string_view name);
// "stage-K.safetensors" and "stage-K.json": stage K's shard and its description in a step directory.
std::string StageShardName(int stage);
std::string StageMetaName(int stage);
// "stage-K.replica-R.safetensors" and "stage-K.replica-R.json": replica R's DiLoCo round state of stage K
// (what it learnt since the last outer synchronisation, and the exchange in flight) in a step directory.
std::string ReplicaShardName(int stage, int replica);
std::string ReplicaMetaName(int stage, int replica);

// Paths relative to the run directory.
std::string WeightsFile(int stage);                               // "weights/stage-K.safetensors"
std::string CheckpointFile(int64_t step, std::string_view name);  // "checkpoints/step-S/NAME"
std::string SiteLogFile(std::string_view site);                   // "sites/SITE.log"

// A file a site may send to the coordinator's run directory, parsed. Only the canonical forms above are
// accepted: weights/stage-K.safetensors, checkpoints/step-S/stage-K.{safetensors,json} and
// checkpoints/step-S/stage-K.replica-R.{safetensors,json}, with 1 <= S < 10^9, 0 <= K < 10^6 and
// 0 <= R < 10^6.
struct SiteFile {
  enum class Kind { kWeights, kCheckpointShard, kCheckpointMeta };
  Kind kind = Kind::kWeights;
  int64_t step = 0;  // checkpoint files only
  int stage = 0;
  int replica = -1;  // checkpoint files: -1 the stage's own; R >= 0 replica R's round state
};
std::optional<SiteFile> ParseSiteFile(std::string_view path);

}  // namespace meridian::core

#endif  // MERIDIAN_CORE_RUN_LAYOUT_H_
