// Checkpoints that do not depend on the partition. Checkpoint of step N lives in DIR/step-N/: each
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

// Writes stage `stage` of `num_stages` for `step` (the number of completed steps). Thread-compatible.
absl::Status WriteCheckpoint(const std::string& dir, int64_t step, int stage, int num_stages,
                             const std::map<std::string, torch::Tensor>& tensors);

// The newest complete and intact checkpoint under `dir`, found as LoadLatestCheckpoint finds it (every
// stage's JSON present, every shard's SHA-256 matching) without loading its tensors.
struct CheckpointFiles {
  int64_t step = 0;
  std::string path;                // DIR/step-S
  std::vector<std::string> files;  // in it: each stage's shard, then its JSON
};
absl::StatusOr<CheckpointFiles> FindLatestCheckpoint(const std::string& dir, std::string* skipped = nullptr);

// After step `step`'s checkpoint: keeps the newest `keep` complete step directories under `dir` up to
// `step` (complete as FindLatestCheckpoint requires, but shards are not hashed) and removes the older
// step directories, complete or not. `step` itself stays whatever its state (stages may still be
// writing it), and so does every step above it (another run's: this run will overwrite or never reach
// them). Returns how many directories were removed; directories it could not remove are named in
// `problems`. REQUIRES: keep >= 1. Call it from one writer per directory.
int PruneCheckpoints(const std::string& dir, int keep, int64_t step, std::string* problems = nullptr);

// Removes every step directory above `step` under `dir`: after resuming from `step`, what an abandoned
// attempt left there (perhaps of another partition) would otherwise mix with the steps this run writes
// again. Returns how many were removed; directories it could not remove are named in `problems`.
int RemoveCheckpointsAbove(const std::string& dir, int64_t step, std::string* problems = nullptr);

struct Checkpoint {
  int64_t step = 0;
  std::map<std::string, torch::Tensor> tensors;  // parameters and optimizer moments of every stage
  std::string path;
};

// For one step directory whose stage JSONs are all present (its shards need not be): the shard files
// holding any of `wanted` (by the JSONs' tensor lists), so a resuming stage fetches only those.
absl::StatusOr<std::vector<std::string>> ShardsHolding(const std::string& step_dir, const std::set<std::string>& wanted);

// Loads from step directory `step_dir` (e.g. DIR/step-S) the shards ShardsHolding names for `wanted`,
// each checked against its SHA-256; the other shards may be absent. Errors name the step or the shard.
absl::StatusOr<Checkpoint> LoadCheckpointFor(const std::string& step_dir, const std::set<std::string>& wanted);

// The newest complete and intact checkpoint under `dir`: every stage's JSON present and every shard's
// SHA-256 matching. A newer checkpoint that is incomplete or corrupt is skipped, and `skipped` says
// why. NotFound when there is none.
absl::StatusOr<Checkpoint> LoadLatestCheckpoint(const std::string& dir, std::string* skipped = nullptr);

}  // namespace meridian::executor

#endif  // MERIDIAN_EXECUTOR_CHECKPOINT_H_
