#include "simulator/fleet.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/files.h"
#include "core/status.h"
#include "nlohmann/json.hpp"

namespace meridian::simulator {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

absl::Status Bad(const std::string& path, const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", field, ": ", what));
}

// node[key] as T into *out when present (else *out is left as it is); a conversion error names the field.
template <typename T>
absl::Status Get(const YAML::Node& node, const char* key, const std::string& path, const std::string& field,
                 const char* expected, T* out) {
  const YAML::Node v = node[key];
  if (!v) return absl::OkStatus();
  try {
    *out = v.as<T>();
  } catch (const YAML::Exception&) {
    return Bad(path, field, absl::StrCat("expected ", expected));
  }
  return absl::OkStatus();
}

absl::StatusOr<json> ReadJson(const std::string& path) {
  auto text = core::ReadFile(path);
  if (!text.ok()) return text.status();
  json j = json::parse(*text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return Bad(path, "top level", "not a JSON object");
  return j;
}

absl::StatusOr<GpuProfile> LoadGpu(const std::string& dir, const std::string& name, const std::string& fleet_path,
                                   const std::string& field) {
  if (name.empty() || name.find('/') != std::string::npos || name[0] == '.')
    return Bad(fleet_path, field, absl::StrCat("'", name, "' is not a device profile name"));
  const std::string path = (fs::path(dir) / (name + ".json")).string();
  auto j = ReadJson(path);
  if (!j.ok()) return Bad(fleet_path, field, absl::StrCat("device '", name, "': ", j.status().message()));
  GpuProfile g;
  g.name = name;
  auto number = [&](const char* key, double* out) -> absl::Status {
    if (!j->contains(key) || !(*j)[key].is_number() || !((*j)[key].get<double>() > 0))
      return Bad(path, key, "expected a positive number");
    *out = (*j)[key].get<double>();
    return absl::OkStatus();
  };
  if (auto s = number("peak_bf16_flops_per_second", &g.peak_bf16_flops_per_second); !s.ok()) return s;
  if (auto s = number("mfu", &g.mfu); !s.ok()) return s;
  if (g.mfu > 1) return Bad(path, "mfu", "expected a share of peak, at most 1");
  if (auto s = number("memory_bytes", &g.memory_bytes); !s.ok()) return s;
  if (j->contains("comment") && (*j)["comment"].is_string()) g.comment = (*j)["comment"].get<std::string>();
  return g;
}

// A codec priced for bf16 tensors: the menu's ratios are per float32 byte.
partitioner::Codec OnBf16(partitioner::Codec c) {
  c.ratio = std::min(1.0, 2 * c.ratio);
  if (c.gradient_ratio > 0) c.gradient_ratio = std::min(1.0, 2 * c.gradient_ratio);
  return c;
}

std::string Layout(const partitioner::Plan& plan) {
  std::vector<std::string> parts;
  bool single = true;
  for (const auto& st : plan.stages) parts.push_back(std::to_string(st.sites.size())), single &= st.sites.size() == 1;
  const std::string stages = absl::StrCat(plan.stages.size(), plan.stages.size() == 1 ? " stage" : " stages");
  if (single) return absl::StrCat(stages, ", one site each");
  return absl::StrCat(stages, " (sites per stage: ", absl::StrJoin(parts, "+"), ")");
}

}  // namespace

absl::StatusOr<Fleet> LoadFleet(const std::string& path) {
  auto text = core::ReadFile(path);
  if (!text.ok()) return text.status();
  YAML::Node root;
  try {
    root = YAML::Load(*text);
  } catch (const YAML::Exception& e) {
    return Bad(path, absl::StrCat("line ", e.mark.line + 1), e.msg);
  }
  if (!root.IsMap()) return Bad(path, "top level", "expected a mapping");
  const fs::path dir = fs::path(path).parent_path();
  Fleet f;
  try {
    for (auto it = root.begin(); it != root.end(); ++it) {
      const std::string key = it->first.Scalar();
      static const char* kKeys[] = {"fleet",         "model", "sequence_length", "micro_batch_size",
                                    "micro_batches", "gpus",  "links",           "bandwidth_gbit",
                                    "uplink_shared", "sites", "diloco"};
      if (std::find(std::begin(kKeys), std::end(kKeys), key) == std::end(kKeys)) return Bad(path, key, "unknown field");
    }
    f.name = fs::path(path).stem().string();
    MERIDIAN_RETURN_IF_ERROR(Get(root, "fleet", path, "fleet", "a name", &f.name));
    std::string model_file;
    MERIDIAN_RETURN_IF_ERROR(Get(root, "model", path, "model", "a path", &model_file));
    if (model_file.empty()) return Bad(path, "model", "missing (an HF config.json of a LLaMA-architecture model)");
    const std::string model = (dir / model_file).string();
    auto config = core::ReadFile(model);
    if (!config.ok()) return Bad(path, "model", std::string(config.status().message()));
    auto shape = partitioner::ParseLlamaConfig(*config, model);
    if (!shape.ok()) return shape.status();
    partitioner::LlamaGraphOptions go;  // bf16 weights, gradients and activations; AdamW state in fp32
    go.sequence_length = 2048;
    go.micro_batch_size = 1;
    MERIDIAN_RETURN_IF_ERROR(Get(root, "sequence_length", path, "sequence_length", "an integer", &go.sequence_length));
    MERIDIAN_RETURN_IF_ERROR(
        Get(root, "micro_batch_size", path, "micro_batch_size", "an integer", &go.micro_batch_size));
    if (go.sequence_length < 1 || go.sequence_length > (1 << 20)) return Bad(path, "sequence_length", "out of range");
    if (go.micro_batch_size < 1 || go.micro_batch_size > 4096) return Bad(path, "micro_batch_size", "out of range");
    f.graph = partitioner::BuildLlamaGraph(*shape, go);
    f.tokens_per_micro_batch = go.sequence_length * go.micro_batch_size;
    MERIDIAN_RETURN_IF_ERROR(Get(root, "micro_batches", path, "micro_batches", "an integer", &f.micro_batches));
    if (f.micro_batches < 1 || f.micro_batches > 65536) return Bad(path, "micro_batches", "expected 1 to 65536");
    if (!root["bandwidth_gbit"]) return Bad(path, "bandwidth_gbit", "missing");
    double gbit = 0;
    MERIDIAN_RETURN_IF_ERROR(Get(root, "bandwidth_gbit", path, "bandwidth_gbit", "a number of Gbit/s", &gbit));
    if (!(gbit > 0) || gbit > 1e4) return Bad(path, "bandwidth_gbit", "expected a positive number of Gbit/s");
    bool shared = true;
    MERIDIAN_RETURN_IF_ERROR(Get(root, "uplink_shared", path, "uplink_shared", "true or false", &shared));
    std::string gpus_dir = "../profiles/gpus", links_file = "links.json";
    MERIDIAN_RETURN_IF_ERROR(Get(root, "gpus", path, "gpus", "a directory", &gpus_dir));
    MERIDIAN_RETURN_IF_ERROR(Get(root, "links", path, "links", "a file name", &links_file));
    const std::string gpus = (dir / gpus_dir).lexically_normal().string();
    const std::string links_path = (fs::path(gpus) / links_file).string();
    auto presets = ReadJson(links_path);
    if (!presets.ok()) return presets.status();
    if (!presets->contains("presets") || !(*presets)["presets"].is_array())
      return Bad(links_path, "presets", "expected a list of link presets");
    // Region pair -> one-way latency: the same region, the same continent (the region's prefix before
    // '-'), or a preset naming the two continents.
    std::map<std::string, std::pair<double, std::string>> by_kind;
    for (const auto& p : (*presets)["presets"]) {
      if (!p.is_object() || !p.contains("name") || !p["name"].is_string() || !p.contains("rtt_ms") ||
          !p["rtt_ms"].is_number() || p["rtt_ms"].get<double>() < 0)
        return Bad(links_path, "presets", "each needs a name and a non-negative rtt_ms");
      const double one_way = p["rtt_ms"].get<double>() / 2e3;
      const std::string name = p["name"].get<std::string>();
      by_kind[name] = {one_way, name};
      if (p.contains("between")) {
        const json& between = p["between"];
        if (!between.is_array() || between.size() != 2 || !between[0].is_string() || !between[1].is_string())
          return Bad(links_path, absl::StrCat("presets.", name, ".between"), "expected two continent names");
        std::string a = between[0].get<std::string>(), b = between[1].get<std::string>();
        if (a > b) std::swap(a, b);
        by_kind[a + "|" + b] = {one_way, name};
      }
    }
    if (!root["sites"] || !root["sites"].IsSequence() || root["sites"].size() == 0)
      return Bad(path, "sites", "expected a list of site groups");
    std::vector<std::string> regions, region_fields;
    std::map<std::string, int> gpu_sites;
    for (size_t i = 0; i < root["sites"].size(); ++i) {
      const YAML::Node g = root["sites"][i];
      const std::string field = absl::StrCat("sites[", i, "]");
      if (!g.IsMap() || !g["gpu"] || !g["region"]) return Bad(path, field, "needs gpu and region");
      std::string gpu_name, region;
      int per_site = 8, count = 1;
      MERIDIAN_RETURN_IF_ERROR(Get(g, "gpu", path, field + ".gpu", "a device profile name", &gpu_name));
      MERIDIAN_RETURN_IF_ERROR(Get(g, "region", path, field + ".region", "a region name", &region));
      MERIDIAN_RETURN_IF_ERROR(Get(g, "per_site", path, field + ".per_site", "an integer", &per_site));
      MERIDIAN_RETURN_IF_ERROR(Get(g, "count", path, field + ".count", "an integer", &count));
      auto gpu = LoadGpu(gpus, gpu_name, path, field + ".gpu");
      if (!gpu.ok()) return gpu.status();
      if (per_site < 1 || per_site > 4096) return Bad(path, field + ".per_site", "expected 1 to 4096 GPUs");
      if (count < 1 || count > 4096) return Bad(path, field + ".count", "expected 1 to 4096 sites");
      if (region.empty()) return Bad(path, field + ".region", "expected a region name");
      if (f.profile.sites.size() + count > 1024) return Bad(path, "sites", "more than 1024 sites");
      for (int c = 0; c < count; ++c) {
        partitioner::SiteProfile s;
        // Numbered across the fleet: two groups of one region and device still name distinct sites.
        s.name = absl::StrCat(region, "-", gpu->name, "x", per_site, "-", f.profile.sites.size() + 1);
        s.flops_per_second = per_site * gpu->peak_bf16_flops_per_second * gpu->mfu;
        s.memory_bytes = per_site * gpu->memory_bytes;
        if (shared) s.uplink_bytes_per_second = gbit * 1e9 / 8;
        s.comment = absl::StrCat(per_site, " x ", gpu->name, " at ", gpu->mfu, " MFU: ", gpu->comment);
        f.profile.sites.push_back(s);
        regions.push_back(region);
        region_fields.push_back(field + ".region");
      }
      gpu_sites[absl::StrCat(per_site, " x ", gpu->name, " (", gpu->comment, ")")] += count;
    }
    auto continent = [](const std::string& r) { return r.substr(0, r.find('-')); };
    std::map<std::string, int> kinds;
    for (size_t a = 0; a < regions.size(); ++a)
      for (size_t b = 0; b < regions.size(); ++b) {
        if (a == b) continue;
        std::string key;
        if (regions[a] == regions[b]) {
          key = "intra-region";
        } else if (continent(regions[a]) == continent(regions[b])) {
          key = "intra-continent";
        } else {
          std::string x = continent(regions[a]), y = continent(regions[b]);
          if (x > y) std::swap(x, y);
          key = x + "|" + y;
        }
        auto it = by_kind.find(key);
        if (it == by_kind.end())
          return Bad(path, region_fields[b],
                     absl::StrCat("no preset for regions '", regions[a], "' and '", regions[b], "' (", key, ") in ",
                                  links_path));
        f.profile.links.push_back({f.profile.sites[a].name, f.profile.sites[b].name, gbit * 1e9 / 8, it->second.first});
        ++kinds[it->second.second];
      }
    f.diloco.diloco = true;
    if (const YAML::Node d = root["diloco"]) {
      if (!d.IsMap()) return Bad(path, "diloco", "expected a mapping");
      MERIDIAN_RETURN_IF_ERROR(Get(d, "inner_steps", path, "diloco.inner_steps", "an integer", &f.diloco.inner_steps));
      MERIDIAN_RETURN_IF_ERROR(Get(d, "fragments", path, "diloco.fragments", "an integer", &f.diloco.fragments));
      MERIDIAN_RETURN_IF_ERROR(Get(d, "overlap", path, "diloco.overlap", "true or false", &f.diloco.overlap));
      std::string codec;
      MERIDIAN_RETURN_IF_ERROR(Get(d, "codec", path, "diloco.codec", "a codec name", &codec));
      if (!codec.empty()) {
        auto c = partitioner::PriceCodec(codec);
        if (!c.ok()) return Bad(path, "diloco.codec", std::string(c.status().message()));
        f.diloco.codec = *c;
      }
      if (f.diloco.inner_steps < 1 || f.diloco.inner_steps > 10000)
        return Bad(path, "diloco.inner_steps", "expected 1 to 10000");
      if (f.diloco.fragments < 1 || f.diloco.fragments > f.diloco.inner_steps)
        return Bad(path, "diloco.fragments", "expected 1 to inner_steps");
    }
    f.diloco.codec = OnBf16(f.diloco.codec);
    for (const auto& [what, n] : gpu_sites) f.notes.push_back(absl::StrCat(n, " site(s) of ", what));
    for (const auto& [kind, n] : kinds)
      f.notes.push_back(absl::StrCat(n, " directed links ", kind, " (", links_path, ")"));
    f.notes.push_back(
        absl::StrFormat("every link %.3g Gbit/s%s", gbit, shared ? ", a site's links sharing its uplink" : ""));
  } catch (const YAML::Exception& e) {
    return Bad(path, e.mark.is_null() ? "fleet" : absl::StrCat("line ", e.mark.line + 1), e.msg);
  }
  return f;
}

std::vector<SystemProjection> ProjectFleet(const Fleet& fleet, const SimulationOptions& options) {
  using Clock = std::chrono::steady_clock;
  auto seconds = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  partitioner::PlanOptions base;
  base.micro_batches = fleet.micro_batches;
  base.replication = true;
  base.adaptive_compression = true;
  base.deep_pipeline = true;
  base.link_codecs.clear();
  for (const auto& c : partitioner::DefaultLinkCodecs()) base.link_codecs.push_back(OnBf16(c));
  base.gradient_codecs.clear();
  for (const auto& c : partitioner::DefaultGradientCodecs()) base.gradient_codecs.push_back(OnBf16(c));
  const int n = static_cast<int>(fleet.profile.sites.size());
  const int ops = static_cast<int>(fleet.graph.ops.size());
  std::vector<SystemProjection> out;
  for (const char* system : {"pipeline", "diloco", "ddp"}) {
    SystemProjection p;
    p.system = system;
    partitioner::PlanOptions o = base;
    if (p.system == "diloco") o.sync = fleet.diloco;
    if (p.system == "ddp") {
      o.replication = false;
      o.fixed_sites = {0};
      o.fixed_last_ops = {ops - 1};
      o.fixed_replicas = {{}};
      for (int s = 1; s < n; ++s) o.fixed_replicas[0].push_back(s);
      o.gradient_codecs = {OnBf16(*partitioner::PriceCodec("identity"))};
    }
    const auto t0 = Clock::now();
    auto plan = partitioner::PlanPipeline(fleet.graph, fleet.profile, o);
    p.plan_seconds = seconds(t0);
    if (!plan.ok()) {
      p.why = std::string(plan.status().message());
      out.push_back(p);
      continue;
    }
    p.layout = Layout(*plan);
    const auto t1 = Clock::now();
    auto sim = Simulate(fleet.graph, fleet.profile, *plan, options);
    p.simulate_seconds = seconds(t1);
    if (!sim.ok()) {
      p.why = std::string(sim.status().message());
      out.push_back(p);
      continue;
    }
    p.feasible = true;
    p.step_seconds = sim->step_seconds;
    p.analytic_step_seconds = sim->analytic_step_seconds;
    p.tokens_per_second = fleet.micro_batches * static_cast<double>(fleet.tokens_per_micro_batch) / sim->step_seconds;
    p.utilisation = sim->utilisation;
    out.push_back(p);
  }
  return out;
}

std::string ProjectionTable(const Fleet& fleet, const std::vector<SystemProjection>& systems) {
  const double bound = partitioner::ComputeBoundSeconds(fleet.graph, fleet.profile, fleet.micro_batches);
  std::string out = absl::StrFormat(
      "fleet %s: %d sites, %d micro-batches of %d tokens; compute bound %.3f s a step "
      "(%.0f tokens/s)\n",
      fleet.name, fleet.profile.sites.size(), fleet.micro_batches, fleet.tokens_per_micro_batch, bound,
      fleet.micro_batches * static_cast<double>(fleet.tokens_per_micro_batch) / bound);
  for (const auto& n : fleet.notes) absl::StrAppend(&out, "  ", n, "\n");
  absl::StrAppendFormat(&out, "%-9s %12s %14s %8s %12s  %s\n", "system", "step_s", "tokens/s", "util", "analytic_s",
                        "layout");
  for (const auto& s : systems) {
    if (!s.feasible) {
      absl::StrAppendFormat(&out, "%-9s does not run: %s\n", s.system, s.why);
      continue;
    }
    absl::StrAppendFormat(&out, "%-9s %12.3f %14.0f %7.1f%% %12.3f  %s (planned in %.2f s, simulated in %.2f s)\n",
                          s.system, s.step_seconds, s.tokens_per_second, 100 * s.utilisation, s.analytic_step_seconds,
                          s.layout, s.plan_seconds, s.simulate_seconds);
  }
  return out;
}

std::string ProjectionJson(const Fleet& fleet, const std::vector<SystemProjection>& systems) {
  json sys = json::array();
  for (const auto& s : systems)
    sys.push_back({{"system", s.system},
                   {"feasible", s.feasible},
                   {"why", s.why},
                   {"layout", s.layout},
                   {"step_seconds", s.step_seconds},
                   {"analytic_step_seconds", s.analytic_step_seconds},
                   {"tokens_per_second", s.tokens_per_second},
                   {"utilisation", s.utilisation},
                   {"plan_seconds", s.plan_seconds},
                   {"simulate_seconds", s.simulate_seconds}});
  return json{{"fleet", fleet.name},
              {"sites", fleet.profile.sites.size()},
              {"micro_batches", fleet.micro_batches},
              {"tokens_per_micro_batch", fleet.tokens_per_micro_batch},
              {"compute_bound_seconds",
               partitioner::ComputeBoundSeconds(fleet.graph, fleet.profile, fleet.micro_batches)},
              {"notes", fleet.notes},
              {"systems", sys}}
             .dump(2) +
         "\n";
}

}  // namespace meridian::simulator
