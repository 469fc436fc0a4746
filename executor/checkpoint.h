// Checkpoints that do not depend on the partition: their tensors (the directory's layout, completeness
// and pruning, which need no torch, are core/checkpoint_dir.h's). Checkpoint of step N lives in DIR/step-N/: each
// stage writes stage-K.safetensors (its parameters by HF name, its AdamW moments as optim.m.NAME /
// optim.v.NAME) and then stage-K.json {step, stage, num_stages, sha256 of the shard, tensor names}.
// Files are written atomically (temporary file, fsync, rename), the JSON last, so a present JSON means
// a complete shard. Resuming with any partition loads each tensor by name from whichever shard has it.
#ifndef MERIDIAN_EXECUTOR_CHECKPOINT_H_
#define MERIDIAN_EXECUTOR_CHECKPOINT_H_

#include <torch/torch.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace meridian::executor {

// Writes stage `stage` of `num_stages` for `step` (the number of completed steps), tagged with `run` (the
// `meridian run` writing it; "" none). Thread-compatible.
absl::Status WriteCheckpoint(const std::string& dir, int64_t step, int stage, int num_stages,
                             const std::map<std::string, torch::Tensor>& tensors, const std::string& run = "");

struct Checkpoint {
  int64_t step = 0;
  std::map<std::string, torch::Tensor> tensors;  // parameters and optimizer moments of every stage
  std::string path;
};

// Loads from step directory `step_dir` (e.g. DIR/step-S) the shards core::ShardsHolding names for `wanted`,
// each checked against its SHA-256; the other shards may be absent. Errors name the step or the shard.
absl::StatusOr<Checkpoint> LoadCheckpointFor(const std::string& step_dir, const std::set<std::string>& wanted);

// The newest complete and intact checkpoint under `dir`: every stage's JSON present and every shard's
// SHA-256 matching, and with `run` non-empty, every stage written by that run (another run's steps in a
// shared directory are never resumed from by mistake). A newer checkpoint that is incomplete, corrupt or
// another run's is skipped, and `skipped` says why. NotFound when there is none.
absl::StatusOr<Checkpoint> LoadLatestCheckpoint(const std::string& dir, std::string* skipped = nullptr,
                                                const std::string& run = "");

}  // namespace meridian::executor

#endif  // MERIDIAN_EXECUTOR_CHECKPOINT_H_
