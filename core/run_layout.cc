#include "core/run_layout.h"

#include <charconv>

#include "absl/strings/str_cat.h"

namespace meridian::core {
namespace {

// A canonical decimal in [lo, hi] (no sign, no leading zero unless it is "0").
std::optional<int64_t> ParseCanonical(std::string_view s, int64_t lo, int64_t hi) {
  if (s.empty() || s.size() > 18 || (s.size() > 1 && s[0] == '0')) return std::nullopt;
  for (char ch : s)
    if (ch < '0' || ch > '9') return std::nullopt;  // no sign: "stage--0" is not stage 0
  int64_t v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || v < lo || v > hi) return std::nullopt;
  return v;
}

bool Consume(std::string_view* s, std::string_view prefix) {
  if (s->substr(0, prefix.size()) != prefix) return false;
  s->remove_prefix(prefix.size());
  return true;
}

constexpr int64_t kMaxStep = 999'999'999;
constexpr int64_t kMaxStage = 999'999;

struct StageFile {
  int stage = 0;
  int replica = -1;  // "stage-K.replica-R.EXT"; -1 for "stage-K.EXT"
  std::string_view ext;
};
// "stage-K.EXT" and "stage-K.replica-R.EXT" -> K, R and EXT.
std::optional<StageFile> ParseStageFile(std::string_view name) {
  if (!Consume(&name, "stage-")) return std::nullopt;
  const size_t dot = name.find('.');
  if (dot == std::string_view::npos) return std::nullopt;
  auto k = ParseCanonical(name.substr(0, dot), 0, kMaxStage);
  if (!k) return std::nullopt;
  StageFile f;
  f.stage = static_cast<int>(*k);
  name.remove_prefix(dot + 1);
  if (Consume(&name, "replica-")) {
    const size_t end = name.find('.');
    if (end == std::string_view::npos) return std::nullopt;
    auto r = ParseCanonical(name.substr(0, end), 0, kMaxStage);
    if (!r) return std::nullopt;
    f.replica = static_cast<int>(*r);
    name.remove_prefix(end + 1);
  }
  f.ext = name;
  return f;
}

}  // namespace

std::string StepDirName(int64_t step) { return absl::StrCat("step-", step); }

std::optional<int64_t> ParseStepDirName(std::string_view name) {
  if (!Consume(&name, "step-")) return std::nullopt;
  return ParseCanonical(name, 1, INT64_MAX / 2);
}

std::string StageShardName(int stage) { return absl::StrCat("stage-", stage, ".safetensors"); }
std::string StageMetaName(int stage) { return absl::StrCat("stage-", stage, ".json"); }
std::string ReplicaShardName(int stage, int replica) {
  return absl::StrCat("stage-", stage, ".replica-", replica, ".safetensors");
}
std::string ReplicaMetaName(int stage, int replica) {
  return absl::StrCat("stage-", stage, ".replica-", replica, ".json");
}

std::string WeightsFile(int stage) { return absl::StrCat(kWeightsDir, "/", StageShardName(stage)); }
std::string CheckpointFile(int64_t step, std::string_view name) {
  return absl::StrCat(kCheckpointsDir, "/", StepDirName(step), "/", std::string(name));
}
std::string SiteLogFile(std::string_view site) { return absl::StrCat(kSiteLogDir, "/", std::string(site), ".log"); }

std::optional<SiteFile> ParseSiteFile(std::string_view path) {
  SiteFile f;
  if (Consume(&path, kWeightsDir) && Consume(&path, "/")) {
    auto stage = ParseStageFile(path);
    if (!stage || stage->replica >= 0 || stage->ext != "safetensors") return std::nullopt;
    f.kind = SiteFile::Kind::kWeights;
    f.stage = stage->stage;
    return f;
  }
  if (!Consume(&path, kCheckpointsDir) || !Consume(&path, "/")) return std::nullopt;
  const size_t slash = path.find('/');
  if (slash == std::string_view::npos) return std::nullopt;
  auto step = ParseStepDirName(path.substr(0, slash));
  if (!step || *step > kMaxStep) return std::nullopt;
  auto stage = ParseStageFile(path.substr(slash + 1));
  if (!stage) return std::nullopt;
  if (stage->ext == "safetensors")
    f.kind = SiteFile::Kind::kCheckpointShard;
  else if (stage->ext == "json")
    f.kind = SiteFile::Kind::kCheckpointMeta;
  else
    return std::nullopt;
  f.step = *step;
  f.stage = stage->stage;
  f.replica = stage->replica;
  return f;
}

}  // namespace meridian::core
