#include "core/checkpoint_dir.h"

#include <algorithm>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/files.h"
#include "core/run_layout.h"

namespace meridian::core {
namespace {

namespace fs = std::filesystem;

// A stage JSON lists its tensor names: a few hundred for a 70B model. Anything far larger is not one.
constexpr int64_t kMaxStageMetaBytes = int64_t{16} << 20;

// stage-K.json's content, or nullopt when it is not one (not JSON, a field missing or of the wrong type,
// a stage outside [0, num_stages), a shard not named after its stage).
std::optional<StageMeta> ParseStageMeta(const std::string& text, int64_t step) {
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("stage") || !j.contains("num_stages") ||
      !j["stage"].is_number_integer() || !j["num_stages"].is_number_integer() || !j.contains("sha256") ||
      !j.contains("shard") || !j["shard"].is_string() || !j["sha256"].is_string())
    return std::nullopt;
  StageMeta m;
  m.step = step;
  m.stage = j["stage"].get<int>();
  m.num_stages = j["num_stages"].get<int>();
  m.shard = j["shard"].get<std::string>();
  m.sha256 = j["sha256"].get<std::string>();
  if (m.num_stages <= 0 || m.stage < 0 || m.stage >= m.num_stages || m.shard != StageShardName(m.stage))
    return std::nullopt;
  if (j.contains("run") && j["run"].is_string()) m.run = j["run"].get<std::string>();
  if (j.contains("tensors") && j["tensors"].is_array()) {
    m.tensors.emplace();
    for (const auto& t : j["tensors"])
      if (t.is_string()) m.tensors->push_back(t.get<std::string>());
  }
  return m;
}

// Removes one step directory; false (and `problems` says why) when it could not.
bool RemoveStepDir(const std::string& path, std::string* problems) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec && problems) absl::StrAppend(problems, path, ": cannot remove (", ec.message(), "); ");
  return !ec;
}

}  // namespace

std::string StageMetaJson(const StageMeta& m) {
  nlohmann::json j = {
      {"step", m.step}, {"stage", m.stage}, {"num_stages", m.num_stages}, {"shard", m.shard}, {"sha256", m.sha256}};
  if (!m.run.empty()) j["run"] = m.run;
  if (m.tensors) j["tensors"] = *m.tensors;
  return j.dump(1);
}

std::string RunIdOfJob(const std::string& job_id) { return job_id.substr(0, job_id.find('-')); }

absl::StatusOr<std::vector<std::pair<int64_t, std::string>>> StepDirs(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> steps;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::error_code kind;
    if (!e.is_directory(kind)) continue;
    if (auto step = ParseStepDirName(e.path().filename().string())) steps.push_back({*step, e.path().string()});
  }
  if (ec) return absl::NotFoundError(absl::StrCat(dir, ": no checkpoints (", ec.message(), ")"));
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

std::optional<std::map<int, StageMeta>> CompleteStages(const std::string& step_dir, std::string* why,
                                                       bool verify_hashes) {
  const int64_t step = ParseStepDirName(fs::path(step_dir).filename().string()).value_or(0);
  int num_stages = -1;
  bool mixed = false;
  std::map<int, StageMeta> metas;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(step_dir, ec)) {
    if (e.path().extension() != ".json") continue;
    auto text = ReadFile(e.path().string(), kMaxStageMetaBytes);
    if (!text.ok()) continue;
    std::optional<StageMeta> m = ParseStageMeta(*text, step);
    if (!m) continue;
    // Shards of two partitions in one step directory (a resumed run re-cut the model and died while
    // writing) do not make a checkpoint.
    if (num_stages >= 0 && m->num_stages != num_stages) mixed = true;
    num_stages = m->num_stages;
    metas[m->stage] = std::move(*m);
  }
  if (ec) {
    absl::StrAppend(why, step_dir, ": cannot list (", ec.message(), "); ");
    return std::nullopt;
  }
  if (mixed) {
    absl::StrAppend(why, step_dir, ": shards of different partitions; ");
    return std::nullopt;
  }
  if (num_stages <= 0 || static_cast<int>(metas.size()) != num_stages) {
    absl::StrAppend(why, step_dir, ": incomplete (", metas.size(), " of ", std::max(num_stages, 0), " stages); ");
    return std::nullopt;
  }
  if (!verify_hashes) return metas;
  for (const auto& [k, meta] : metas) {
    const std::string shard = (fs::path(step_dir) / meta.shard).string();
    auto digest = Sha256OfFile(shard);
    if (!digest.ok() || *digest != meta.sha256) {
      absl::StrAppend(why, shard, ": checksum mismatch (truncated or corrupt); ");
      return std::nullopt;
    }
  }
  return metas;
}

absl::StatusOr<CheckpointFiles> FindLatestCheckpoint(const std::string& dir, std::string* skipped) {
  auto steps = StepDirs(dir);
  if (!steps.ok()) return steps.status();
  std::string why;
  for (const auto& [step, path] : *steps) {
    auto metas = CompleteStages(path, &why, /*verify_hashes=*/true);
    if (!metas) continue;
    if (skipped) *skipped = why;
    CheckpointFiles f;
    f.step = step;
    f.path = path;
    for (const auto& [k, meta] : *metas) {
      f.files.push_back(meta.shard);
      f.files.push_back(StageMetaName(k));
    }
    return f;
  }
  if (skipped) *skipped = why;
  return absl::NotFoundError(absl::StrCat(dir, ": no complete, intact checkpoint", why.empty() ? "" : ": ", why));
}

int PruneCheckpoints(const std::string& dir, int keep, int64_t newest, std::string* problems) {
  auto steps = StepDirs(dir);
  if (!steps.ok()) return 0;
  int complete = 0, removed = 0;
  std::string ignored;                       // why a step is incomplete: not a problem here
  for (const auto& [step, path] : *steps) {  // newest first
    if (step > newest) continue;             // another run's
    if (step < newest && complete >= keep) {
      removed += RemoveStepDir(path, problems);
      continue;
    }
    complete += CompleteStages(path, &ignored, /*verify_hashes=*/false).has_value();
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

std::string ManifestJson(const Manifest& m) {
  nlohmann::json stages = nlohmann::json::array();
  for (size_t k = 0; k < m.stages.size(); ++k)
    stages.push_back({{"stage", k},
                      {"writer", m.stages[k].writer},
                      {"shard", StageShardName(static_cast<int>(k))},
                      {"sha256", m.stages[k].shard_sha256},
                      {"meta", StageMetaName(static_cast<int>(k))},
                      {"meta_sha256", m.stages[k].meta_sha256}});
  return nlohmann::json{{"step", m.step}, {"num_stages", m.num_stages}, {"job_id", m.job_id}, {"stages", stages}}.dump(
      1);
}

std::optional<Manifest> ReadManifest(const std::string& step_dir, std::string* why) {
  const std::string path = (fs::path(step_dir) / kManifestFile).string();
  auto text = ReadFile(path, int64_t{1} << 20);
  if (!text.ok()) {
    absl::StrAppend(why, step_dir, ": no manifest; ");
    return std::nullopt;
  }
  auto j = nlohmann::json::parse(*text, nullptr, false);
  Manifest m;
  bool ok = j.is_object() && j.contains("step") && j["step"].is_number_integer() && j.contains("num_stages") &&
            j["num_stages"].is_number_integer() && j.contains("stages") && j["stages"].is_array();
  if (ok) {
    m.step = j["step"].get<int64_t>();
    m.num_stages = j["num_stages"].get<int>();
    if (j.contains("job_id") && j["job_id"].is_string()) m.job_id = j["job_id"].get<std::string>();
    ok = m.num_stages > 0 && static_cast<int>(j["stages"].size()) == m.num_stages &&
         ParseStepDirName(fs::path(step_dir).filename().string()) == m.step;
    for (size_t k = 0; ok && k < j["stages"].size(); ++k) {
      const auto& s = j["stages"][k];
      ok = s.is_object() && s.contains("sha256") && s["sha256"].is_string() && s.contains("meta_sha256") &&
           s["meta_sha256"].is_string() && s.contains("writer") && s["writer"].is_string();
      if (ok)
        m.stages.push_back(
            {s["writer"].get<std::string>(), s["sha256"].get<std::string>(), s["meta_sha256"].get<std::string>()});
    }
  }
  if (!ok) {
    absl::StrAppend(why, path, ": malformed; ");
    return std::nullopt;
  }
  return m;
}

std::optional<CheckpointFiles> ManifestedCheckpoint(const std::string& step_dir, int64_t step, std::string* why) {
  std::optional<Manifest> m = ReadManifest(step_dir, why);
  if (!m) return std::nullopt;
  CheckpointFiles f{step, step_dir, {}};
  for (int k = 0; k < m->num_stages; ++k)
    for (const auto& [name, sha] : {std::pair<std::string, std::string>{StageShardName(k), m->stages[k].shard_sha256},
                                    {StageMetaName(k), m->stages[k].meta_sha256}}) {
      auto digest = Sha256OfFile((fs::path(step_dir) / name).string());
      if (!digest.ok() || *digest != sha) {
        absl::StrAppend(why, step_dir, "/", name, ": does not match the manifest (truncated, corrupt or replaced); ");
        return std::nullopt;
      }
      f.files.push_back(name);
    }
  for (int k = 0; k < m->num_stages; ++k) {  // the JSONs were just checked against the manifest
    auto text = ReadFile((fs::path(step_dir) / StageMetaName(k)).string(), kMaxStageMetaBytes);
    std::optional<StageMeta> meta = text.ok() ? ParseStageMeta(*text, step) : std::nullopt;
    if (meta && meta->tensors) f.shard_tensors[StageShardName(k)] = *meta->tensors;
  }
  return f;
}

absl::StatusOr<CheckpointFiles> FindLatestManifested(const std::string& dir, std::string* skipped) {
  auto steps = StepDirs(dir);
  if (!steps.ok()) return steps.status();
  std::string why;
  for (const auto& [step, path] : *steps) {
    std::optional<CheckpointFiles> f = ManifestedCheckpoint(path, step, &why);
    if (!f) continue;
    if (skipped) *skipped = why;
    return *std::move(f);
  }
  if (skipped) *skipped = why;
  return absl::NotFoundError(absl::StrCat(dir, ": no manifested, intact checkpoint", why.empty() ? "" : ": ", why));
}

int PruneManifested(const std::string& dir, int keep, int64_t newest, std::string* problems) {
  auto steps = StepDirs(dir);
  if (!steps.ok()) return 0;
  int kept = 0, removed = 0;
  std::string ignored;
  for (const auto& [step, path] : *steps) {  // newest first
    if (step > newest) continue;             // not reached yet (or another run's)
    if (kept >= std::max(keep, 1)) {
      removed += RemoveStepDir(path, problems);
      continue;
    }
    kept += ReadManifest(path, &ignored).has_value();
  }
  return removed;
}

absl::StatusOr<std::vector<std::string>> ShardsHolding(const std::string& step_dir,
                                                       const std::set<std::string>& wanted) {
  std::string why;
  auto metas = CompleteStages(step_dir, &why, /*verify_hashes=*/false);
  if (!metas) return absl::NotFoundError(absl::StrCat("no complete checkpoint: ", why));
  std::vector<std::string> shards;
  for (const auto& [k, meta] : *metas) {
    bool holds = !meta.tensors;  // unknown: fetch it
    if (meta.tensors)
      holds = std::any_of(meta.tensors->begin(), meta.tensors->end(), [&](const auto& t) { return wanted.count(t); });
    if (holds) shards.push_back(meta.shard);
  }
  return shards;
}

}  // namespace meridian::core
