#include "coordinator/simulate_command.h"

#include <CLI/CLI.hpp>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

#include "core/cluster_spec.h"
#include "core/files.h"
#include "partitioner/model.h"
#include "simulator/simulator.h"

namespace meridian::coordinator {

namespace {

// Per plan site, the median over a run's steps (after the first) of its compute seconds per micro-batch,
// from metrics.jsonl lines {"step": N, "stages": [{"site": S, "compute_seconds": X}, ...]}.
absl::StatusOr<std::map<std::string, double>> MeasuredComputePerMicroBatch(const std::string& path,
                                                                         const partitioner::Plan& plan) {
  auto text = core::ReadFile(path);
  if (!text.ok()) return text.status();
  std::map<std::string, int> share;
  for (const auto& st : plan.stages)
    for (size_t r = 0; r < st.site_names.size(); ++r) share[st.site_names[r]] = st.micro_batches[r];
  std::map<std::string, std::vector<double>> samples;
  std::istringstream lines(*text);
  std::string line;
  for (int n = 1; std::getline(lines, line); ++n) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("stages") || !j["stages"].is_array())
      return absl::InvalidArgumentError(absl::StrCat(path, ":", n, ": expected a metrics object with stages"));
    if (j.value("step", 0) <= 1) continue;
    for (const auto& s : j["stages"]) {
      if (!s.is_object() || !s.contains("site") || !s["site"].is_string() || !s.contains("compute_seconds") ||
          !s["compute_seconds"].is_number())
        return absl::InvalidArgumentError(absl::StrCat(path, ":", n, ": stages: expected site and compute_seconds"));
      auto it = share.find(s["site"].get<std::string>());
      if (it == share.end() || it->second == 0) continue;
      samples[it->first].push_back(s["compute_seconds"].get<double>() / it->second);
    }
  }
  std::map<std::string, double> out;
  for (auto& [site, v] : samples) {
    std::sort(v.begin(), v.end());
    out[site] = v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no step after the first of the plan's sites"));
  return out;
}

}  // namespace

void AddSimulateOptions(CLI::App* cmd, SimulateCommandOptions* o) {
  cmd->add_option("--plan", o->plan_path, "plan.json (meridian plan --json, or a run's), or a run directory")
      ->required();
  cmd->add_option("--graph", o->graph_path, "Operator graph (graph.json); default: the run directory's");
  cmd->add_option("--profile", o->profile_path, "Cluster profile (profile.json); default: the run directory's");
  cmd->add_option("--steps", o->steps, "Steps to simulate (default: 3, or two DiLoCo rounds)")
      ->check(CLI::Range(1, 100000));
  cmd->add_option("--job", o->job_path, "Job spec (YAML) whose sync section replaces the plan's");
  cmd->add_option("--compute-from", o->compute_from,
                  "A run's metrics.jsonl: use each site's measured compute per micro-batch instead of the profile's");
  cmd->add_flag("--json", o->json, "Print the result as one JSON object");
  cmd->add_option("--svg", o->svg_path, "Write a timeline (Gantt chart) of the last simulated step to this file");
}

int RunSimulateCommand(const SimulateCommandOptions& o) {
  namespace fs = std::filesystem;
  auto fail = [](const auto& status) {
    std::cerr << "meridian simulate: " << status.message() << "\n";
    return 2;
  };
  std::string plan_path = o.plan_path, graph_path = o.graph_path, profile_path = o.profile_path;
  std::error_code ec;
  if (fs::is_directory(plan_path, ec)) {
    const fs::path dir = plan_path;
    plan_path = (dir / "plan.json").string();
    if (graph_path.empty()) graph_path = (dir / "graph.json").string();
    if (profile_path.empty()) profile_path = (dir / "profile.json").string();
  }
  if (graph_path.empty() || profile_path.empty()) {
    std::cerr << "meridian simulate: --graph and --profile are required unless --plan is a run directory\n";
    return 2;
  }
  auto graph = partitioner::LoadGraphFile(graph_path);
  if (!graph.ok()) return fail(graph.status());
  auto profile = partitioner::LoadProfileFile(profile_path);
  if (!profile.ok()) return fail(profile.status());
  auto text = core::ReadFile(plan_path);
  if (!text.ok()) return fail(text.status());
  auto plan = simulator::ParsePlanJson(*text, plan_path, *graph, *profile);
  if (!plan.ok()) return fail(plan.status());
  if (!o.job_path.empty()) {
    const core::SpecLoadResult spec = core::LoadSpecFile(o.job_path);
    if (!spec.errors.empty()) {
      for (const auto& e : spec.errors) std::cerr << e.ToString() << "\n";
      return 2;
    }
    if (!spec.spec->job) {
      std::cerr << "meridian simulate: " << o.job_path << ": no job section\n";
      return 2;
    }
    plan->sync = partitioner::SyncModelOf(spec.spec->job->sync);
  }
  if (!o.compute_from.empty()) {
    auto seconds = MeasuredComputePerMicroBatch(o.compute_from, *plan);
    if (!seconds.ok()) return fail(seconds.status());
    auto calibrated = simulator::CalibrateCompute(*graph, *profile, *plan, *seconds);
    if (!calibrated.ok()) return fail(calibrated.status());
    *profile = std::move(*calibrated);
  }
  simulator::SimulationOptions so;
  so.steps = o.steps;
  auto result = simulator::Simulate(*graph, *profile, *plan, so);
  if (!result.ok()) return fail(result.status());
  std::cout << (o.json ? simulator::SimulationJson(*result) : simulator::SimulationTable(*result));
  if (!o.svg_path.empty()) {
    std::ofstream svg(o.svg_path);
    svg << simulator::TimelineSvg(*result);
    if (!svg) {
      std::cerr << "meridian simulate: " << o.svg_path << ": cannot write\n";
      return 1;
    }
  }
  return 0;
}

}  // namespace meridian::coordinator
