#include "core/checkpoint_dir.h"

#include <algorithm>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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

bool IsIntArray(const nlohmann::json& j) {
  return j.is_array() && std::all_of(j.begin(), j.end(), [](const auto& x) { return x.is_number_integer(); });
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

std::string ReplicaMetaJson(const ReplicaMeta& m) {
  nlohmann::json j = {
      {"step", m.step},         {"stage", m.stage},     {"num_stages", m.num_stages},       {"replica", m.replica},
      {"first_op", m.first_op}, {"last_op", m.last_op}, {"micro_batches", m.micro_batches}, {"shard", m.shard},
      {"sha256", m.sha256}};
  if (!m.run.empty()) j["run"] = m.run;
  if (m.synchronised) j["synchronised"] = true;
  return j.dump(1);
}

std::optional<ReplicaMeta> ParseReplicaMeta(const std::string& text, int64_t step) {
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return std::nullopt;
  for (const char* key : {"stage", "num_stages", "replica", "first_op", "last_op"})
    if (!j.contains(key) || !j[key].is_number_integer()) return std::nullopt;
  for (const char* key : {"shard", "sha256"})
    if (!j.contains(key) || !j[key].is_string()) return std::nullopt;
  if (!j.contains("micro_batches") || !IsIntArray(j["micro_batches"])) return std::nullopt;
  ReplicaMeta m;
  m.step = step;
  m.stage = j["stage"].get<int>();
  m.num_stages = j["num_stages"].get<int>();
  m.replica = j["replica"].get<int>();
  m.first_op = j["first_op"].get<int>();
  m.last_op = j["last_op"].get<int>();
  m.micro_batches = j["micro_batches"].get<std::vector<int>>();
  m.shard = j["shard"].get<std::string>();
  m.sha256 = j["sha256"].get<std::string>();
  if (j.contains("run") && j["run"].is_string()) m.run = j["run"].get<std::string>();
  if (j.contains("synchronised") && j["synchronised"].is_boolean()) m.synchronised = j["synchronised"].get<bool>();
  if (m.num_stages <= 0 || m.stage < 0 || m.stage >= m.num_stages || m.replica < 0 ||
      m.replica >= static_cast<int>(m.micro_batches.size()) || m.shard != ReplicaShardName(m.stage, m.replica))
    return std::nullopt;
  return m;
}

bool RoundStateFits(const ReplicaMeta& m, const ReplicaLayout& layout, std::string* why) {
  if (m.stage == layout.stage && m.num_stages == layout.num_stages && m.first_op == layout.first_op &&
      m.last_op == layout.last_op && m.micro_batches == layout.micro_batches)
    return true;
  absl::StrAppend(why, "stage ", layout.stage, ": replica ", m.replica, "'s round state was written for stage ",
                  m.stage, " of ", m.num_stages, ", ops ", m.first_op, "-", m.last_op, ", shares [",
                  absl::StrJoin(m.micro_batches, ", "), "]; it resumes as stage ", layout.stage, " of ",
                  layout.num_stages, ", ops ", layout.first_op, "-", layout.last_op, ", shares [",
                  absl::StrJoin(layout.micro_batches, ", "), "]; ");
  return false;
}

bool RoundStatesMatch(const std::map<int, ReplicaMeta>& metas, const ReplicaLayout& layout, std::string* why) {
  for (int r = 0; r < static_cast<int>(layout.micro_batches.size()); ++r) {
    auto it = metas.find(r);
    if (it == metas.end()) {
      absl::StrAppend(why, "stage ", layout.stage, ": no round state of replica ", r, "; ");
      return false;
    }
    if (!RoundStateFits(it->second, layout, why)) return false;
  }
  return true;
}

std::map<int, ReplicaMeta> RoundStatesIn(const std::string& step_dir, int stage, bool verify_hashes, std::string* why) {
  const int64_t step = ParseStepDirName(fs::path(step_dir).filename().string()).value_or(0);
  std::map<int, ReplicaMeta> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(step_dir, ec)) {
    const std::string name = e.path().filename().string();
    const std::string prefix = absl::StrCat("stage-", stage, ".replica-");
    if (name.rfind(prefix, 0) != 0 || e.path().extension() != ".json") continue;
    auto text = ReadFile(e.path().string(), kMaxStageMetaBytes);
    std::optional<ReplicaMeta> m = text.ok() ? ParseReplicaMeta(*text, step) : std::nullopt;
    if (!m || m->stage != stage || ReplicaMetaName(m->stage, m->replica) != name) {
      absl::StrAppend(why, e.path().string(), ": not a replica's round state; ");
      continue;
    }
    if (verify_hashes) {
      auto digest = Sha256OfFile((fs::path(step_dir) / m->shard).string());
      if (!digest.ok() || *digest != m->sha256) {
        absl::StrAppend(why, step_dir, "/", m->shard, ": checksum mismatch (truncated or corrupt); ");
        continue;
      }
    }
    out[m->replica] = std::move(*m);
  }
  return out;
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
  for (size_t k = 0; k < m.stages.size(); ++k) {
    const int stage = static_cast<int>(k);
    nlohmann::json s = {{"stage", k},
                        {"writer", m.stages[k].writer},
                        {"shard", StageShardName(stage)},
                        {"sha256", m.stages[k].shard_sha256},
                        {"meta", StageMetaName(stage)},
                        {"meta_sha256", m.stages[k].meta_sha256}};
    if (!m.stages[k].replicas.empty()) {
      nlohmann::json replicas = nlohmann::json::array();
      for (const auto& r : m.stages[k].replicas)
        replicas.push_back({{"replica", r.replica},
                            {"writer", r.writer},
                            {"shard", ReplicaShardName(stage, r.replica)},
                            {"sha256", r.shard_sha256},
                            {"meta", ReplicaMetaName(stage, r.replica)},
                            {"meta_sha256", r.meta_sha256}});
      s["replicas"] = std::move(replicas);
    }
    stages.push_back(std::move(s));
  }
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
      if (!ok) break;
      Manifest::Stage stage{
          s["writer"].get<std::string>(), s["sha256"].get<std::string>(), s["meta_sha256"].get<std::string>(), {}};
      if (s.contains("replicas")) {
        ok = s["replicas"].is_array();
        for (size_t i = 0; ok && i < s["replicas"].size(); ++i) {
          const auto& r = s["replicas"][i];
          ok = r.is_object() && r.contains("replica") && r["replica"].is_number_integer() && r["replica"] >= 0 &&
               r.contains("writer") && r["writer"].is_string() && r.contains("sha256") && r["sha256"].is_string() &&
               r.contains("meta_sha256") && r["meta_sha256"].is_string();
          if (ok)
            stage.replicas.push_back({r["replica"].get<int>(), r["writer"].get<std::string>(),
                                      r["sha256"].get<std::string>(), r["meta_sha256"].get<std::string>()});
        }
      }
      m.stages.push_back(std::move(stage));
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
  // The round states listed: each whose files match the manifest and whose JSON parses as what it is named.
  for (int k = 0; k < m->num_stages; ++k)
    for (const auto& r : m->stages[k].replicas) {
      bool match = true;
      for (const auto& [name, sha] :
           {std::pair<std::string, std::string>{ReplicaShardName(k, r.replica), r.shard_sha256},
            {ReplicaMetaName(k, r.replica), r.meta_sha256}}) {
        auto digest = Sha256OfFile((fs::path(step_dir) / name).string());
        if (!digest.ok() || *digest != sha) {
          absl::StrAppend(&f.round_state_problems, step_dir, "/", name,
                          ": does not match the manifest (truncated, corrupt or replaced); ");
          match = false;
          break;
        }
      }
      if (!match) continue;
      auto text = ReadFile((fs::path(step_dir) / ReplicaMetaName(k, r.replica)).string(), kMaxStageMetaBytes);
      std::optional<ReplicaMeta> meta = text.ok() ? ParseReplicaMeta(*text, step) : std::nullopt;
      if (meta && meta->stage == k && meta->replica == r.replica) f.round_states[k][r.replica] = std::move(*meta);
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
