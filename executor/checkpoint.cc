#include "executor/checkpoint.h"

#include <algorithm>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "core/checkpoint_dir.h"
#include "core/files.h"
#include "core/run_layout.h"
#include "executor/torch_boundary.h"
#include "executor/trainer.h"

namespace meridian::executor {
namespace {

namespace fs = std::filesystem;

// Adds a shard's tensors to `into`; a tensor two shards both claim is an error (each tensor has one
// owning stage: a shard that repeats another's is forged or from another partition).
absl::Status Merge(std::map<std::string, torch::Tensor> shard, const std::string& shard_path,
                   std::map<std::string, torch::Tensor>* into) {
  for (auto& [name, t] : shard)
    if (!into->emplace(name, std::move(t)).second)
      return absl::DataLossError(absl::StrCat(shard_path, ": tensor ", name, " is also in another shard of the step"));
  return absl::OkStatus();
}

// The tensors of shard `file` once its SHA-256 is `sha256`; DataLoss naming the file otherwise.
absl::StatusOr<std::map<std::string, torch::Tensor>> LoadVerified(const std::string& file, const std::string& sha256) {
  auto digest = core::Sha256OfFile(file);
  if (!digest.ok()) return digest.status();
  if (*digest != sha256) return absl::DataLossError(absl::StrCat(file, ": checksum mismatch (truncated or corrupt)"));
  return LoadParameters(file);
}

}  // namespace

absl::Status WriteCheckpoint(const std::string& dir, int64_t step, int stage, int num_stages,
                             const std::map<std::string, torch::Tensor>& tensors, const std::string& run) {
  return GuardTorch(absl::StrCat("writing the checkpoint of step ", step, " in ", dir), [&]() -> absl::Status {
    const std::string sdir = (fs::path(dir) / core::StepDirName(step)).string();
    std::error_code ec;
    fs::create_directories(sdir, ec);
    if (ec) return absl::InternalError(absl::StrCat(sdir, ": cannot create: ", ec.message()));
    core::StageMeta meta;
    meta.step = step;
    meta.stage = stage;
    meta.num_stages = num_stages;
    meta.shard = core::StageShardName(stage);
    meta.run = run;
    const std::string shard = (fs::path(sdir) / meta.shard).string();
    if (absl::Status s = SaveParameters(shard, tensors); !s.ok()) return s;  // written whole: tmp, fsync, rename
    auto digest = core::Sha256OfFile(shard);
    if (!digest.ok()) return digest.status();
    meta.sha256 = *digest;
    meta.tensors.emplace();
    for (const auto& [n, t] : tensors) meta.tensors->push_back(n);
    return core::WriteFileAtomic((fs::path(sdir) / core::StageMetaName(stage)).string(), core::StageMetaJson(meta));
  });
}

absl::Status WriteRoundState(const std::string& dir, core::ReplicaMeta meta,
                             const std::map<std::string, torch::Tensor>& tensors) {
  return GuardTorch(absl::StrCat("writing replica ", meta.replica, "'s round state of step ", meta.step, " in ", dir),
                    [&]() -> absl::Status {
                      const std::string sdir = (fs::path(dir) / core::StepDirName(meta.step)).string();
                      std::error_code ec;
                      fs::create_directories(sdir, ec);
                      if (ec) return absl::InternalError(absl::StrCat(sdir, ": cannot create: ", ec.message()));
                      meta.shard = core::ReplicaShardName(meta.stage, meta.replica);
                      const std::string shard = (fs::path(sdir) / meta.shard).string();
                      if (absl::Status s = SaveParameters(shard, tensors); !s.ok()) return s;
                      auto digest = core::Sha256OfFile(shard);
                      if (!digest.ok()) return digest.status();
                      meta.sha256 = *digest;
                      return core::WriteFileAtomic(
                          (fs::path(sdir) / core::ReplicaMetaName(meta.stage, meta.replica)).string(),
                          core::ReplicaMetaJson(meta));
                    });
}

absl::StatusOr<std::optional<std::map<std::string, torch::Tensor>>> LoadRoundState(const std::string& step_dir,
                                                                                   const core::ReplicaLayout& layout,
                                                                                   int replica, bool check_all,
                                                                                   std::string* why) {
  using Result = std::optional<std::map<std::string, torch::Tensor>>;
  return GuardTorch(
      absl::StrCat("loading replica ", replica, "'s round state from ", step_dir), [&]() -> absl::StatusOr<Result> {
        std::map<int, core::ReplicaMeta> metas = core::RoundStatesIn(step_dir, layout.stage, check_all, why);
        if (!check_all) {  // this replica's only: the coordinator matched the others
          auto own = metas.find(replica);
          if (own == metas.end()) {
            absl::StrAppend(why, "stage ", layout.stage, ": no round state of replica ", replica, "; ");
            return Result();
          }
          if (!core::RoundStateFits(own->second, layout, why)) return Result();
        } else if (!core::RoundStatesMatch(metas, layout, why)) {
          return Result();
        }
        const core::ReplicaMeta& meta = metas.at(replica);
        auto tensors = LoadVerified((fs::path(step_dir) / meta.shard).string(), meta.sha256);
        if (!tensors.ok()) return tensors.status();
        return Result(std::move(*tensors));
      });
}

absl::StatusOr<Checkpoint> LoadLatestCheckpoint(const std::string& dir, std::string* skipped, const std::string& run) {
  return GuardTorch(absl::StrCat("loading the newest checkpoint of ", dir), [&]() -> absl::StatusOr<Checkpoint> {
    auto steps = core::StepDirs(dir);
    if (!steps.ok()) return steps.status();
    std::string why;
    for (const auto& [step, path] : *steps) {  // newest first
      auto metas = core::CompleteStages(path, &why, /*verify_hashes=*/true);
      if (!metas) continue;
      if (!run.empty()) {
        const auto other =
            std::find_if(metas->begin(), metas->end(), [&](const auto& m) { return m.second.run != run; });
        if (other != metas->end()) {
          absl::StrAppend(&why, path, ": written by ",
                          other->second.run.empty() ? "no `meridian run`" : "run " + other->second.run,
                          ", not this run (", run, "); ");
          continue;
        }
      }
      Checkpoint c;
      c.step = step;
      c.path = path;
      bool loaded = true;
      for (const auto& [k, meta] : *metas) {
        auto tensors = LoadParameters((fs::path(path) / meta.shard).string());
        if (!tensors.ok()) {
          absl::StrAppend(&why, tensors.status().message(), "; ");
          loaded = false;
          break;
        }
        if (absl::Status s = Merge(std::move(*tensors), (fs::path(path) / meta.shard).string(), &c.tensors); !s.ok()) {
          absl::StrAppend(&why, s.message(), "; ");
          loaded = false;
          break;
        }
      }
      if (!loaded) continue;
      if (skipped) *skipped = why;
      return c;
    }
    if (skipped) *skipped = why;
    return absl::NotFoundError(absl::StrCat(dir, ": no complete, intact checkpoint", why.empty() ? "" : ": ", why));
  });
}

absl::StatusOr<Checkpoint> LoadCheckpointFor(const std::string& step_dir, const std::set<std::string>& wanted) {
  return GuardTorch(absl::StrCat("loading the checkpoint ", step_dir), [&]() -> absl::StatusOr<Checkpoint> {
    const fs::path path(step_dir);
    const std::optional<int64_t> step = core::ParseStepDirName(path.filename().string());
    if (!step) return absl::InvalidArgumentError(absl::StrCat(step_dir, ": not a step-S directory"));
    auto shards = core::ShardsHolding(step_dir, wanted);
    if (!shards.ok())
      return absl::Status(shards.status().code(), absl::StrCat(step_dir, ": ", shards.status().message()));
    std::string why;
    auto metas = core::CompleteStages(step_dir, &why, /*verify_hashes=*/false);
    if (!metas) return absl::NotFoundError(absl::StrCat(step_dir, ": no complete checkpoint: ", why));
    Checkpoint c;
    c.step = *step;
    c.path = step_dir;
    for (const auto& [k, meta] : *metas) {
      if (std::find(shards->begin(), shards->end(), meta.shard) == shards->end()) continue;
      const std::string file = (path / meta.shard).string();
      auto tensors = LoadVerified(file, meta.sha256);
      if (!tensors.ok()) return tensors.status();
      if (absl::Status s = Merge(std::move(*tensors), file, &c.tensors); !s.ok()) return s;
    }
    return c;
  });
}

}  // namespace meridian::executor
