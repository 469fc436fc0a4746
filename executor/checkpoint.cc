#include "executor/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/files.h"
#include "core/safetensors.h"
#include "executor/trainer.h"

namespace meridian::executor {
namespace {

namespace fs = std::filesystem;

}  // namespace

absl::Status WriteCheckpoint(const std::string& dir, int64_t step, int stage, int num_stages,
                             const std::map<std::string, torch::Tensor>& tensors) {
  const std::string sdir = absl::StrCat(dir, "/step-", step);
  std::error_code ec;
  fs::create_directories(sdir, ec);
  if (ec) return absl::InternalError(absl::StrCat(sdir, ": cannot create: ", ec.message()));
  const std::string shard = absl::StrCat(sdir, "/stage-", stage, ".safetensors");
  if (absl::Status s = SaveParameters(shard, tensors); !s.ok()) return s;  // written whole: tmp, fsync, rename
  auto digest = core::Sha256OfFile(shard);
  if (!digest.ok()) return digest.status();
  nlohmann::json names = nlohmann::json::array();
  for (const auto& [n, t] : tensors) names.push_back(n);
  nlohmann::json j = {{"step", step}, {"stage", stage}, {"num_stages", num_stages},
                      {"shard", fs::path(shard).filename().string()}, {"sha256", *digest},
                      {"tensors", names}};
  return core::WriteFileAtomic(absl::StrCat(sdir, "/stage-", stage, ".json"), j.dump(1));
}

namespace {

// The step directories under `dir`, newest first.
absl::StatusOr<std::vector<std::pair<int64_t, fs::path>>> StepDirs(const std::string& dir) {
  std::vector<std::pair<int64_t, fs::path>> steps;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    std::error_code kind;
    if (e.is_directory(kind) && name.rfind("step-", 0) == 0) {
      char* end = nullptr;
      long long n = std::strtoll(name.c_str() + 5, &end, 10);
      // Only canonical names ("step-7", not "step-007"): a step has one directory.
      if (*end == '\0' && n > 0 && name == absl::StrCat("step-", n)) steps.push_back({n, e.path()});
    }
  }
  if (ec) return absl::NotFoundError(absl::StrCat(dir, ": no checkpoints (", ec.message(), ")"));
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

// The stage JSONs of step directory `path` by stage, when they make a complete checkpoint: objects with
// integer stage in [0, num_stages), one partition (the same num_stages), every stage present, each naming
// its shard "stage-K.safetensors" -- and, with `hash`, every shard matching its SHA-256. Otherwise
// nullopt, with the reason appended to `why`.
std::optional<std::map<int, nlohmann::json>> IntactStages(const fs::path& path, std::string* why, bool hash) {
  int num_stages = -1;
  bool mixed = false;
  std::map<int, nlohmann::json> metas;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(path, ec)) {
    if (e.path().extension() != ".json") continue;
    std::ifstream in(e.path());
    auto j = nlohmann::json::parse(in, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("stage") || !j.contains("num_stages") ||
        !j["stage"].is_number_integer() || !j["num_stages"].is_number_integer() || !j.contains("sha256") ||
        !j.contains("shard") || !j["shard"].is_string() || !j["sha256"].is_string())
      continue;
    const int stage = j["stage"].get<int>(), n = j["num_stages"].get<int>();
    if (n <= 0 || stage < 0 || stage >= n || j["shard"].get<std::string>() != absl::StrCat("stage-", stage, ".safetensors"))
      continue;
    // Shards of two partitions in one step directory (a resumed run re-cut the model and died while
    // writing) do not make a checkpoint.
    if (num_stages >= 0 && n != num_stages) mixed = true;
    num_stages = n;
    metas[stage] = j;
  }
  if (ec) {
    absl::StrAppend(why, path.string(), ": cannot list (", ec.message(), "); ");
    return std::nullopt;
  }
  if (mixed) {
    absl::StrAppend(why, path.string(), ": shards of different partitions; ");
    return std::nullopt;
  }
  if (num_stages <= 0 || static_cast<int>(metas.size()) != num_stages) {
    absl::StrAppend(why, path.string(), ": incomplete (", metas.size(), " of ", std::max(num_stages, 0), " stages); ");
    return std::nullopt;
  }
  if (!hash) return metas;
  for (const auto& [k, meta] : metas) {
    const std::string shard = (path / meta["shard"].get<std::string>()).string();
    auto digest = core::Sha256OfFile(shard);
    if (!digest.ok() || *digest != meta["sha256"].get<std::string>()) {
      absl::StrAppend(why, shard, ": checksum mismatch (truncated or corrupt); ");
      return std::nullopt;
    }
  }
  return metas;
}

}  // namespace

namespace {

// Removes one step directory; false (and `problems` says why) when it could not.
bool RemoveStepDir(const fs::path& path, std::string* problems) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec && problems) absl::StrAppend(problems, path.string(), ": cannot remove (", ec.message(), "); ");
  return !ec;
}

}  // namespace

int PruneCheckpoints(const std::string& dir, int keep, int64_t newest, std::string* problems) {
  auto steps = StepDirs(dir);
  if (!steps.ok()) return 0;
  int complete = 0, removed = 0;
  std::string ignored;  // why a step is incomplete: not a problem here
  for (const auto& [step, path] : *steps) {  // newest first
    if (step > newest) continue;             // another run's
    if (step < newest && complete >= keep) {
      removed += RemoveStepDir(path, problems);
      continue;
    }
    complete += IntactStages(path, &ignored, /*hash=*/false).has_value();
  }
  return removed;
}

int RemoveCheckpointsAbove(const std::string& dir, int64_t newest, std::string* problems) {
  auto steps = StepDirs(dir);
  if (!steps.ok()) return 0;
  int removed = 0;
  for (const auto& [step, path] : *steps)
    if (step > newest) removed += RemoveStepDir(path, problems);
  return removed;
}

namespace {

// Calls `use(step, path, stages)` on the complete, intact step directories under `dir`, newest first,
// until it returns a value; `use` may refuse a step (nullopt) after appending why to its last argument.
template <typename T, typename Use>
absl::StatusOr<T> FromNewestIntact(const std::string& dir, std::string* skipped, Use use) {
  auto steps = StepDirs(dir);
  if (!steps.ok()) return steps.status();
  std::string why;
  for (const auto& [step, path] : *steps) {
    auto metas = IntactStages(path, &why, /*hash=*/true);
    if (!metas) continue;
    std::optional<T> got = use(step, path, *metas, &why);
    if (!got) continue;
    if (skipped) *skipped = why;
    return std::move(*got);
  }
  if (skipped) *skipped = why;
  return absl::NotFoundError(absl::StrCat(dir, ": no complete, intact checkpoint", why.empty() ? "" : ": ", why));
}

}  // namespace

absl::StatusOr<CheckpointFiles> FindLatestCheckpoint(const std::string& dir, std::string* skipped) {
  return FromNewestIntact<CheckpointFiles>(
      dir, skipped,
      [](int64_t step, const fs::path& path, const std::map<int, nlohmann::json>& metas, std::string*) {
        CheckpointFiles f;
        f.step = step;
        f.path = path.string();
        for (const auto& [k, meta] : metas) {
          f.files.push_back(meta["shard"].get<std::string>());
          f.files.push_back(absl::StrCat("stage-", k, ".json"));
        }
        return std::optional<CheckpointFiles>(std::move(f));
      });
}

absl::StatusOr<Checkpoint> LoadLatestCheckpoint(const std::string& dir, std::string* skipped) {
  return FromNewestIntact<Checkpoint>(
      dir, skipped,
      [](int64_t step, const fs::path& path, const std::map<int, nlohmann::json>& metas,
         std::string* why) -> std::optional<Checkpoint> {
        Checkpoint c;
        c.step = step;
        c.path = path.string();
        for (const auto& [k, meta] : metas) {
          auto tensors = LoadParameters((path / meta["shard"].get<std::string>()).string());
          if (!tensors.ok()) {
            absl::StrAppend(why, tensors.status().message(), "; ");
            return std::nullopt;
          }
          c.tensors.insert(tensors->begin(), tensors->end());
        }
        return c;
      });
}

absl::StatusOr<std::vector<std::string>> ShardsHolding(const std::string& step_dir,
                                                      const std::set<std::string>& wanted) {
  std::string why;
  auto metas = IntactStages(step_dir, &why, /*hash=*/false);
  if (!metas) return absl::NotFoundError(absl::StrCat("no complete checkpoint: ", why));
  std::vector<std::string> shards;
  for (const auto& [k, meta] : *metas) {
    bool holds = !meta.contains("tensors") || !meta["tensors"].is_array();  // unknown: fetch it
    if (!holds)
      for (const auto& t : meta["tensors"])
        if (t.is_string() && wanted.count(t.get<std::string>())) {
          holds = true;
          break;
        }
    if (holds) shards.push_back(meta["shard"].get<std::string>());
  }
  return shards;
}

absl::StatusOr<Checkpoint> LoadCheckpointFor(const std::string& step_dir, const std::set<std::string>& wanted) {
  const fs::path path(step_dir);
  const std::string name = path.filename().string();
  char* end = nullptr;
  const long long step = name.rfind("step-", 0) == 0 ? std::strtoll(name.c_str() + 5, &end, 10) : 0;
  if (step <= 0 || *end != '\0') return absl::InvalidArgumentError(absl::StrCat(step_dir, ": not a step-S directory"));
  auto shards = ShardsHolding(step_dir, wanted);
  if (!shards.ok()) return absl::Status(shards.status().code(), absl::StrCat(step_dir, ": ", shards.status().message()));
  std::string why;
  auto metas = IntactStages(path, &why, /*hash=*/false);
  Checkpoint c;
  c.step = step;
  c.path = step_dir;
  for (const auto& [k, meta] : *metas) {
    const std::string shard = meta["shard"].get<std::string>();
    if (std::find(shards->begin(), shards->end(), shard) == shards->end()) continue;
    const std::string file = (path / shard).string();
    auto digest = core::Sha256OfFile(file);
    if (!digest.ok()) return digest.status();
    if (*digest != meta["sha256"].get<std::string>())
      return absl::DataLossError(absl::StrCat(file, ": checksum mismatch (truncated or corrupt)"));
    auto tensors = LoadParameters(file);
    if (!tensors.ok()) return tensors.status();
    c.tensors.insert(tensors->begin(), tensors->end());
  }
  return c;
}

}  // namespace meridian::executor
