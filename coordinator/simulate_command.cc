#include "coordinator/simulate_command.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <set>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

#include "core/cluster_spec.h"
#include "core/files.h"
#include "partitioner/model.h"
#include "simulator/failures.h"
#include "simulator/fleet.h"
#include "simulator/simulator.h"

namespace meridian::coordinator {

namespace {

// Per plan site, the median over a run's steps (after the first) of its compute seconds per micro-batch,
// from metrics.jsonl lines {"stages": [{"site": S, "step": N, "compute_seconds": X}, ...]}. The executor's
// compute time includes its clipping and optimizer step: what the profile says they take
// (partitioner::OptimizerSeconds, simulated on its own) is taken off first; an error names a site that
// computed less than that.
absl::StatusOr<std::map<std::string, double>> MeasuredComputePerMicroBatch(const std::string& path,
                                                                           const partitioner::Plan& plan,
                                                                           const partitioner::OpGraph& graph,
                                                                           const partitioner::ClusterProfile& profile) {
  auto text = core::ReadFile(path);
  if (!text.ok()) return text.status();
  std::map<std::string, int> share;
  std::map<std::string, double> optimizer;
  for (const auto& st : plan.stages)
    for (size_t r = 0; r < st.site_names.size(); ++r) {
      share[st.site_names[r]] = st.micro_batches[r];
      optimizer[st.site_names[r]] =
          partitioner::OptimizerSeconds(graph, profile.sites[st.sites[r]], st.first_op, st.last_op, plan.zero);
    }
  std::map<std::string, std::vector<double>> samples;
  std::set<std::pair<std::string, int64_t>> seen;
  std::istringstream lines(*text);
  std::string line;
  for (int n = 1; std::getline(lines, line); ++n) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("stages") || !j["stages"].is_array())
      return absl::InvalidArgumentError(absl::StrCat(path, ":", n, ": expected a metrics object with stages"));
    for (const auto& s : j["stages"]) {
      if (!s.is_object() || !s.contains("site") || !s["site"].is_string() || !s.contains("compute_seconds") ||
          !s["compute_seconds"].is_number() || !s.contains("step") || !s["step"].is_number_integer())
        return absl::InvalidArgumentError(
            absl::StrCat(path, ":", n, ": stages: expected site, step and compute_seconds"));
      // Each line repeats every stage's latest report: count each (site, step) once, after the first step.
      const std::string site = s["site"].get<std::string>();
      const int64_t step = s["step"].get<int64_t>();
      if (step <= 1 || !seen.insert({site, step}).second) continue;
      auto it = share.find(site);
      if (it == share.end() || it->second == 0) continue;
      const double passes = s["compute_seconds"].get<double>() - optimizer[site];
      if (!(passes > 0))
        return absl::InvalidArgumentError(absl::StrCat(
            path, ":", n, ": site '", site, "' computed ", s["compute_seconds"].get<double>(), " s in step ", step,
            ", not more than the ", optimizer[site], " s its profile gives its optimizer step"));
      samples[it->first].push_back(passes / it->second);
    }
  }
  std::map<std::string, double> out;
  for (auto& [site, v] : samples) {
    std::sort(v.begin(), v.end());
    out[site] = v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  }
  if (out.empty())
    return absl::InvalidArgumentError(absl::StrCat(path, ": no step after the first of the plan's sites"));
  return out;
}

}  // namespace

void AddSimulateOptions(CLI::App* cmd, SimulateCommandOptions* o) {
  cmd->add_option("--plan", o->plan_path, "plan.json (meridian plan --json, or a run's), or a run directory");
  cmd->add_option("--fleet", o->fleet_path,
                  "A fleet (YAML, docs/scale.md): plan and simulate the pipeline, DiLoCo and DDP over it");
  cmd->add_option("--graph", o->graph_path, "Operator graph (graph.json); default: the run directory's");
  cmd->add_option("--profile", o->profile_path, "Cluster profile (profile.json); default: the run directory's");
  cmd->add_option("--steps", o->steps, "Steps to simulate (default: 3, or two DiLoCo rounds)")
      ->check(CLI::Range(1, 100000));
  cmd->add_option("--job", o->job_path, "Job spec (YAML) whose sync section replaces the plan's");
  cmd->add_option("--compute-from", o->compute_from,
                  "A run's metrics.jsonl: use each site's measured compute per micro-batch instead of the profile's");
  cmd->add_flag("--json", o->json, "Print the result as one JSON object");
  cmd->add_option("--mtbf-hours", o->mtbf_hours,
                  "Also estimate goodput over a long run in which every plan site fails this often (hours, mean)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--site-mtbf", o->site_mtbf, "SITE=HOURS: one site's MTBF (repeatable; overrides --mtbf-hours)");
  cmd->add_option("--detect-seconds", o->detect_seconds,
                  "With failures: seconds to detect a lost site (default: the --job spec's heartbeat timeout, else 5)");
  cmd->add_option("--restore-seconds", o->restore_seconds,
                  "With failures: seconds to re-plan, re-assign and load the checkpoint (default: the checkpoint's "
                  "cost plus two steps)");
  cmd->add_option(
      "--checkpoint-seconds", o->checkpoint_seconds,
      "With failures: seconds one checkpoint blocks the run (default: the largest stage's state at 100 MB/s)");
  cmd->add_option("--checkpoint-interval", o->checkpoint_interval,
                  "With failures: steps between checkpoints (default: the --job spec's checkpoint.interval, else 50)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--run-hours", o->run_hours, "With failures: the run's wall-clock length (default 168)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--svg", o->svg_path, "Write a timeline (Gantt chart) of the last simulated step to this file");
}

int RunSimulateCommand(const SimulateCommandOptions& o) {
  namespace fs = std::filesystem;
  auto fail = [](const auto& status) {
    std::cerr << "meridian simulate: " << status.message() << "\n";
    return 2;
  };
  if (o.plan_path.empty() == o.fleet_path.empty()) {
    std::cerr << "meridian simulate: give --plan (a plan or a run directory) or --fleet, one of them\n";
    return 2;
  }
  if (!o.fleet_path.empty()) {
    auto fleet = simulator::LoadFleet(o.fleet_path);
    if (!fleet.ok()) return fail(fleet.status());
    simulator::SimulationOptions so;
    so.steps = o.steps;
    const auto systems = simulator::ProjectFleet(*fleet, so);
    std::cout << (o.json ? simulator::ProjectionJson(*fleet, systems) : simulator::ProjectionTable(*fleet, systems));
    return 0;
  }
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
  const bool failures = o.mtbf_hours > 0 || !o.site_mtbf.empty();
  simulator::FailureModel fm;
  if (failures) {
    for (const auto& st : plan->stages)
      for (const auto& site : st.site_names) fm.mtbf_seconds[site] = o.mtbf_hours > 0 ? o.mtbf_hours * 3600 : -1;
    for (const auto& entry : o.site_mtbf) {
      const size_t eq = entry.find('=');
      double hours = 0;
      std::istringstream in(eq == std::string::npos ? "" : entry.substr(eq + 1));
      std::string rest;
      if (eq == std::string::npos || !(in >> hours) || (in >> rest) || !(hours > 0)) {
        std::cerr << "meridian simulate: --site-mtbf " << entry << ": expected SITE=HOURS with HOURS > 0\n";
        return 2;
      }
      const std::string site = entry.substr(0, eq);
      if (!fm.mtbf_seconds.count(site)) {
        std::cerr << "meridian simulate: --site-mtbf " << entry << ": the plan has no site '" << site << "'\n";
        return 2;
      }
      fm.mtbf_seconds[site] = hours * 3600;
    }
    for (const auto& [site, mtbf] : fm.mtbf_seconds)
      if (mtbf < 0) {
        std::cerr << "meridian simulate: site '" << site << "' has no MTBF: give --mtbf-hours or --site-mtbf " << site
                  << "=HOURS\n";
        return 2;
      }
  }
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
    fm.interval_steps = spec.spec->job->checkpoint.interval;
    if (spec.spec->cluster) fm.detection_seconds = spec.spec->cluster->heartbeat_timeout_seconds;
  }
  if (!o.compute_from.empty()) {
    auto seconds = MeasuredComputePerMicroBatch(o.compute_from, *plan, *graph, *profile);
    if (!seconds.ok()) return fail(seconds.status());
    auto calibrated = simulator::CalibrateCompute(*graph, *profile, *plan, *seconds);
    if (!calibrated.ok()) return fail(calibrated.status());
    *profile = std::move(*calibrated);
  }
  simulator::SimulationOptions so;
  so.steps = o.steps;
  auto result = simulator::Simulate(*graph, *profile, *plan, so);
  if (!result.ok()) return fail(result.status());
  if (!failures) {
    std::cout << (o.json ? simulator::SimulationJson(*result) : simulator::SimulationTable(*result));
  } else {
    if (o.checkpoint_interval > 0) fm.interval_steps = o.checkpoint_interval;
    if (fm.interval_steps < 1) {
      std::cerr << "meridian simulate: the job takes no checkpoints (checkpoint.interval 0): every failure "
                   "restarts the run; give --checkpoint-interval\n";
      return 2;
    }
    if (o.detect_seconds >= 0) fm.detection_seconds = o.detect_seconds;
    // What a checkpoint writes: each stage's weights and optimizer state (a replica 0 per stage writes).
    double state_bytes = 0;
    for (const auto& st : plan->stages) {
      double bytes = 0;
      for (int op = st.first_op; op <= st.last_op; ++op)
        bytes += graph->ops[op].param_bytes / 2 + graph->ops[op].optimizer_bytes;  // param_bytes: + gradients
      state_bytes = std::max(state_bytes, bytes);
    }
    const bool estimated_checkpoint = o.checkpoint_seconds < 0, estimated_restore = o.restore_seconds < 0;
    fm.checkpoint_seconds = estimated_checkpoint ? state_bytes / 100e6 : o.checkpoint_seconds;
    fm.restore_seconds = estimated_restore ? fm.checkpoint_seconds + 2 * result->step_seconds : o.restore_seconds;
    fm.run_seconds = o.run_hours * 3600;
    auto f = simulator::SimulateFailures(result->step_seconds, fm);
    if (!f.ok()) return fail(f.status());
    if (o.json) {
      auto j = nlohmann::json::parse(simulator::SimulationJson(*result));
      j["failures"] = {{"system_mtbf_seconds", f->system_mtbf_seconds},
                       {"expected_failures", f->expected_failures},
                       {"run_seconds", fm.run_seconds},
                       {"detection_seconds", fm.detection_seconds},
                       {"restore_seconds", fm.restore_seconds},
                       {"checkpoint_seconds", fm.checkpoint_seconds},
                       {"checkpoint_interval_steps", fm.interval_steps},
                       {"goodput", f->goodput},
                       {"goodput_p10", f->goodput_p10},
                       {"analytic_goodput", f->analytic_goodput},
                       {"best_interval_steps", f->best_interval_steps},
                       {"best_interval_goodput", f->best_interval_goodput},
                       {"young_interval_steps", f->young_interval_steps}};
      std::cout << j.dump(1) << "\n";
    } else {
      std::cout << simulator::SimulationTable(*result);
      std::cout << absl::StrFormat(
          "\nfailures over a %.0f h run: system MTBF %.1f h (%d site(s)), %.1f failures expected\n"
          "  each: %.1f s to detect + %.1f s to restore%s + the steps since the newest checkpoint\n"
          "  checkpoints every %d steps, %.1f s each%s\n"
          "  goodput %.1f%% (one run in ten below %.1f%%; closed form %.1f%%); the best interval is %d steps "
          "(%.1f%%; Young's sqrt(2 C M): %.0f)\n",
          o.run_hours, f->system_mtbf_seconds / 3600, static_cast<int>(fm.mtbf_seconds.size()), f->expected_failures,
          fm.detection_seconds, fm.restore_seconds,
          estimated_restore ? " (estimated: the checkpoint's cost + 2 steps)" : "", fm.interval_steps,
          fm.checkpoint_seconds,
          estimated_checkpoint
              ? absl::StrFormat(" (estimated: %.0f MB of the largest stage at 100 MB/s)", state_bytes / 1e6)
              : "",
          100 * f->goodput, 100 * f->goodput_p10, 100 * f->analytic_goodput, f->best_interval_steps,
          100 * f->best_interval_goodput, f->young_interval_steps);
    }
  }
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
