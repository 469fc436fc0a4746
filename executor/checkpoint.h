// Checkpoints that do not depend on the partition: their tensors (the directory's layout, completeness
// and pruning, which need no torch, are core/checkpoint_dir.h's). Checkpoint of step N lives in DIR/step-N/: each
// stage writes stage-K.safetensors (its parameters by HF name, its AdamW moments as optim.m.NAME /
// optim.v.NAME) and then stage-K.json {step, stage, num_stages, sha256 of the shard, tensor names}.
// Files are written atomically (temporary file, fsync, rename), the JSON last, so a present JSON means
// a complete shard. Resuming with any partition loads each tensor by name from whichever shard has it.
// DiLoCo replicas also write their round state beside (stage-K.replica-R.*: core/run_layout.h), which
// only the same replicas of the same stage resume.
#ifndef MERIDIAN_EXECUTOR_CHECKPOINT_H_
#define MERIDIAN_EXECUTOR_CHECKPOINT_H_

#include <torch/torch.h>

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/checkpoint_dir.h"

namespace meridian::executor {

// Writes stage `stage` of `num_stages` for `step` (the number of completed steps), tagged with `run` (the
// `meridian run` writing it; "" none). Thread-compatible.
absl::Status WriteCheckpoint(const std::string& dir, int64_t step, int stage, int num_stages,
                             const std::map<std::string, torch::Tensor>& tensors, const std::string& run = "");

struct Checkpoint {
  int64_t step = 0;
  std::map<std::string, torch::Tensor> tensors;  // parameters and optimizer moments of every stage
  std::string path;
  // store: coordinator: the coordinator chose the files fetched into `path` (a DiLoCo replica's round
  // state is among them only when every replica of its stage resumes its own); store: shared, false:
  // the replica checks every replica's round state itself (LoadRoundState).
  bool chosen_by_coordinator = false;
};

// Writes replica `meta.replica`'s DiLoCo round state of stage `meta.stage` for step `meta.step` under
// `dir` (DIR/step-S/stage-K.replica-R.safetensors, then its JSON, each atomically); `meta`'s shard and
// SHA-256 are filled in here. Thread-compatible.
absl::Status WriteRoundState(const std::string& dir, core::ReplicaMeta meta,
                             const std::map<std::string, torch::Tensor>& tensors);

// Replica `replica`'s round state in step directory `step_dir` for a stage resumed as `layout`, when
// the stage's replicas resume their own (all or none, so that they agree on the exchange in flight):
// with `check_all`, every replica's JSON must be there, describe `layout` and vouch for an intact shard;
// otherwise only this replica's (the coordinator checked the others). nullopt, and why (appended), when
// they do not; an error when this replica's own shard does not load.
absl::StatusOr<std::optional<std::map<std::string, torch::Tensor>>> LoadRoundState(const std::string& step_dir,
                                                                                   const core::ReplicaLayout& layout,
                                                                                   int replica, bool check_all,
                                                                                   std::string* why);

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
