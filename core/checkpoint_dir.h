// A checkpoint directory without tensors: which steps it holds, whether a step is complete and intact,
// which shards hold which tensors, pruning. The coordinator's checkpoint store and the executors share it
// (the executors read and write the shards themselves, executor/checkpoint.h). Paths follow
// core/run_layout.h: DIR/step-S/stage-K.safetensors and stage-K.json, the JSON written last.
// Functions are thread-compatible; call the ones that remove directories from one writer per directory.
#ifndef MERIDIAN_CORE_CHECKPOINT_DIR_H_
#define MERIDIAN_CORE_CHECKPOINT_DIR_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace meridian::core {

// What stage-K.json says about stage K's shard of step `step`.
struct StageMeta {
  int64_t step = 0;
  int stage = 0, num_stages = 0;
  std::string shard;                                // "stage-K.safetensors"
  std::string sha256;                               // of the shard file, 64 hex digits
  std::optional<std::vector<std::string>> tensors;  // the tensor names in the shard, when listed
  // The `meridian run` that wrote it (its run id, RunIdOfJob); "" when not written under one (a
  // standalone executor, or a checkpoint older than the field).
  std::string run;
};
// What stage-K.replica-R.json says about replica R's DiLoCo round state of stage K (its shard
// stage-K.replica-R.safetensors: executor/diloco.h). A resumed replica takes it only when the stage it
// resumes is the same: the same stage of the same number of stages, the same ops, the same replicas
// with the same shares of a step's micro-batches (RoundStatesMatch).
struct ReplicaMeta {
  int64_t step = 0;
  int stage = 0, num_stages = 0, replica = 0;
  int first_op = 0, last_op = 0;
  std::vector<int> micro_batches;  // every replica's share of a step's micro-batches, by replica
  std::string shard, sha256;       // "stage-K.replica-R.safetensors", of the shard file
  std::string run;                 // as StageMeta's
  // Written right after every fragment was synchronised (a step boundary's or the run's last): every
  // replica then held the outer parameters, which hold what each sent of its progress in the round.
  // Informative only (what the coordinator says); optional in the JSON, false when absent.
  bool synchronised = false;
};
std::string ReplicaMetaJson(const ReplicaMeta& meta);
// stage-K.replica-R.json's content as written in step directory `step`'s, or nullopt when it is not one
// (not JSON, a field missing or of the wrong type, a replica without a share, a shard not named after it).
std::optional<ReplicaMeta> ParseReplicaMeta(const std::string& text, int64_t step);

// A stage as a resuming attempt's plan has it.
struct ReplicaLayout {
  int stage = 0, num_stages = 0, first_op = 0, last_op = 0;
  std::vector<int> micro_batches;  // by replica
};
// Whether `meta` was written for a replica of `layout`; otherwise false, and why (appended).
bool RoundStateFits(const ReplicaMeta& meta, const ReplicaLayout& layout, std::string* why);
// Whether `metas` (by replica) are the round states of every replica of `layout`, each written for it;
// otherwise false, and why (appended).
bool RoundStatesMatch(const std::map<int, ReplicaMeta>& metas, const ReplicaLayout& layout, std::string* why);
// The round states of stage `stage` in step directory `step_dir` whose JSON parses and, with
// `verify_hashes`, whose shard matches its SHA-256 (those that do not are named in `why`), by replica.
std::map<int, ReplicaMeta> RoundStatesIn(const std::string& step_dir, int stage, bool verify_hashes, std::string* why);

// The run id of an attempt's job id: `meridian run` names attempts RUN and RUN-N.
std::string RunIdOfJob(const std::string& job_id);
// The text of stage-K.json for `meta`.
std::string StageMetaJson(const StageMeta& meta);

// The canonical step directories under `dir` (step-S, S >= 1), newest first. NotFound when `dir` cannot
// be listed.
absl::StatusOr<std::vector<std::pair<int64_t, std::string>>> StepDirs(const std::string& dir);

// The stage JSONs of step directory `step_dir` by stage, when they make a complete checkpoint: every
// stage of one partition (the same num_stages) present, each naming its shard "stage-K.safetensors" --
// and, with `verify_hashes`, every shard matching its SHA-256. Otherwise nullopt, with the reason appended
// to `why`.
std::optional<std::map<int, StageMeta>> CompleteStages(const std::string& step_dir, std::string* why,
                                                       bool verify_hashes);

// The newest complete and intact checkpoint under `dir` (CompleteStages with hashes), without reading
// its tensors. A newer step that is incomplete or corrupt is skipped, and `skipped` says why. NotFound
// when there is none.
struct CheckpointFiles {
  int64_t step = 0;
  std::string path;                // DIR/step-S
  std::vector<std::string> files;  // in it: each stage's shard, then its JSON
  // FindLatestManifested: shard file name -> the tensors its stage JSON lists (shards listing none absent).
  std::map<std::string, std::vector<std::string>> shard_tensors;
  // FindLatestManifested: the replicas' round states the manifest lists and whose files match it, by
  // stage and replica (their files are not in `files`).
  std::map<int, std::map<int, ReplicaMeta>> round_states;
  std::string round_state_problems;  // listed round states left out, and why
};
absl::StatusOr<CheckpointFiles> FindLatestCheckpoint(const std::string& dir, std::string* skipped = nullptr);

// After step `step`'s checkpoint: keeps the newest `keep` complete step directories under `dir` up to
// `step` (complete as CompleteStages requires, but shards are not hashed) and removes the older step
// directories, complete or not. `step` itself stays whatever its state (stages may still be writing it),
// and so does every step above it (another run's: this run will overwrite or never reach them). Returns
// how many directories were removed; directories it could not remove are named in `problems`.
// REQUIRES: keep >= 1.
int PruneCheckpoints(const std::string& dir, int keep, int64_t step, std::string* problems = nullptr);

// Removes every step directory above `step` under `dir`: after resuming from `step`, what an abandoned
// attempt left there (perhaps of another partition) would otherwise mix with the steps this run writes
// again. Returns how many were removed; directories it could not remove are named in `problems`.
int RemoveCheckpointsAbove(const std::string& dir, int64_t step, std::string* problems = nullptr);

// The coordinator's record of a checkpoint step it holds (job.checkpoint.store: coordinator), written by
// the coordinator itself as step-S/manifest.json once every stage's writer of the running plan uploaded
// its shard and JSON, each checked against the plan. Only manifested steps are resumed from or kept: a
// site can upload its own stage's files, never make a step count. The DiLoCo replicas' round states
// are listed as they arrive (the coordinator writes the manifest again for each): a step counts without
// them, and a resumed stage then starts every replica from replica 0's state.
struct Manifest {
  int64_t step = 0;
  int num_stages = 0;
  std::string job_id;  // the attempt that wrote it
  struct Replica {
    int replica = 0;
    std::string writer;
    std::string shard_sha256, meta_sha256;
  };
  struct Stage {
    std::string writer;  // the site that uploaded it
    std::string shard_sha256, meta_sha256;
    std::vector<Replica> replicas;  // round states that arrived, by replica
  };
  std::vector<Stage> stages;  // by stage
};
inline constexpr char kManifestFile[] = "manifest.json";
std::string ManifestJson(const Manifest& manifest);
// Reads step_dir/manifest.json; nullopt (with why, appended) when absent or malformed.
std::optional<Manifest> ReadManifest(const std::string& step_dir, std::string* why);

// Step directory `step_dir` (of step `step`) when the coordinator manifested it and each of its stages'
// shard and JSON matches the manifest's SHA-256: its files and, per shard, the tensors its stage JSON
// lists. Otherwise nullopt, with the reason appended to `why`.
std::optional<CheckpointFiles> ManifestedCheckpoint(const std::string& step_dir, int64_t step, std::string* why);

// The newest manifested step under `dir` whose files all match the manifest's SHA-256 (a newer one that
// does not is skipped, and `skipped` says why). NotFound when there is none.
absl::StatusOr<CheckpointFiles> FindLatestManifested(const std::string& dir, std::string* skipped = nullptr);

// Pruning of the coordinator's store: keeps the newest `keep` manifested steps up to `step` and removes
// the step directories older than the oldest kept (manifested or not); the newest manifested step is
// always kept. Returns how many were removed; what it could not remove is named in `problems`.
// REQUIRES: keep >= 1.
int PruneManifested(const std::string& dir, int keep, int64_t step, std::string* problems = nullptr);

// For one step directory whose stage JSONs are all present (its shards need not be): the shard files
// holding any of `wanted` (by the JSONs' tensor lists; a shard whose JSON lists none is named too), so a
// resuming stage fetches only those.
absl::StatusOr<std::vector<std::string>> ShardsHolding(const std::string& step_dir,
                                                       const std::set<std::string>& wanted);

}  // namespace meridian::core

#endif  // MERIDIAN_CORE_CHECKPOINT_DIR_H_
