#include "coordinator/plan_command.h"

#include <CLI/CLI.hpp>

#include <fstream>
#include <iostream>
#include <numeric>
#include <sstream>

#include "absl/strings/str_format.h"
#include "coordinator/inspect.h"
#include "core/files.h"
#include "nlohmann/json.hpp"
#include "partitioner/model.h"
#include "partitioner/planner.h"
#include "simulator/simulator.h"

namespace meridian::coordinator {

void AddPlanOptions(CLI::App* cmd, PlanCommandOptions* o) {
  cmd->add_option("--graph", o->graph_path, "Operator graph (graph.json); required unless --live");
  cmd->add_option("--profile", o->profile_path, "Cluster profile (profile.json); required unless --live");
  cmd->add_flag("--live", o->live, "Plan over a running coordinator's measured profile and model graph");
  cmd->add_option("--coordinator", o->coordinator, "With --live: HOST:PORT of the running coordinator");
  cmd->add_option("--certs", o->certs_dir, "With --live: the cluster's certificate directory");
  cmd->add_option("--as", o->identity, "With --live: identity to present (default: coordinator)");
  cmd->add_option("--micro-batches", o->micro_batches, "Micro-batches per step (M)")->check(CLI::Range(1, 1 << 16));
  cmd->add_option_function<double>(
         "--ratio", [o](const double& r) { o->ratio = r, o->ratio_given = true; },
         "Fixed compression ratio on every link (compressed/original); disables adaptive compression")
      ->check(CLI::Range(1e-6, 1.0));
  cmd->add_flag("--reference", o->reference,
                "Reference cost model: no replication, the fixed --ratio (default 1) on every link");
  cmd->add_flag("--no-replication", o->no_replication, "Do not replicate stages on spare sites");
  cmd->add_flag("--no-recompute", o->no_recompute,
                "Never recompute activations to keep more micro-batches in flight than a stage's memory holds "
                "(1F1B's window, or the depth a slow link needs)");
  cmd->add_flag("--heuristic", o->force_heuristic, "Use the heuristic even where exact search applies");
  cmd->add_option("--zero", o->zero,
                  "ZeRO stage inside sites of several workers (job.optimizer.zero): 1 shards their optimizer state")
      ->check(CLI::Range(0, 1));
  cmd->add_option("--step-overlap", o->step_overlap,
                  "Micro-batches of each step begun on the step before's weights (job.step_overlap): bounds every "
                  "stage's depth and adds a copy of its weights")
      ->check(CLI::Range(0, 1 << 16));
  cmd->add_option("--revisit-fraction", o->revisit_fraction,
                  "Share of the run's sequence visits that revisit a sequence (fine-tuning epochs): offers the "
                  "AQ-SGD codec int4-delta on the adaptive menu (meridian run computes it)")
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--simulate", o->simulate,
                  "Simulate the planner's K best candidate layouts and rank them by simulated step")
      ->check(CLI::Range(1, 64));
  cmd->add_flag("--json", o->json, "Print the plan as JSON");
  cmd->add_option("--dot", o->dot_path, "Also write the plan as Graphviz to this file");
}

namespace {

std::string LayoutText(const partitioner::PlanCandidate& c, const partitioner::ClusterProfile& profile) {
  std::string out;
  for (size_t k = 0; k < c.sites.size(); ++k) {
    if (k) out += " | ";
    for (size_t r = 0; r < c.sites[k].size(); ++r) out += (r ? "+" : "") + profile.sites[c.sites[k][r]].name;
    out += " to op " + std::to_string(c.last_ops[k]);
  }
  return out;
}

// `meridian plan --simulate K`: the planner's K best candidates, each planned as a fixed layout (codecs
// and depths chosen as for the plan) and simulated; printed in the planner's order with the simulated
// step and rank, then the plan the simulation ranks first (table or JSON).
int SimulateCandidates(const PlanCommandOptions& o, const partitioner::OpGraph& graph,
                       const partitioner::ClusterProfile& profile, const partitioner::PlanOptions& po,
                       const partitioner::Plan& best) {
  struct Row {
    partitioner::PlanCandidate candidate;
    partitioner::Plan plan;
    double simulated = 0;
  };
  std::vector<Row> rows;
  for (const auto& c : best.candidates) {
    if (static_cast<int>(rows.size()) == o.simulate) break;
    partitioner::PlanOptions fixed = po;
    fixed.replication = false;
    partitioner::PinLayout(c.sites, c.last_ops, &fixed, c.shares);
    auto plan = partitioner::PlanPipeline(graph, profile, fixed);
    if (!plan.ok()) continue;
    auto sim = simulator::Simulate(graph, profile, *plan);
    if (!sim.ok()) {
      std::cerr << "meridian plan: simulating candidate " << rows.size() + 1 << ": " << sim.status().message() << "\n";
      return 2;
    }
    rows.push_back({c, *plan, sim->step_seconds});
  }
  if (rows.empty()) {
    std::cerr << "meridian plan: no candidate layout to simulate\n";
    return 2;
  }
  std::vector<size_t> order(rows.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return rows[a].simulated < rows[b].simulated; });
  std::vector<size_t> rank(rows.size());
  for (size_t i = 0; i < order.size(); ++i) rank[order[i]] = i + 1;
  const size_t first = order[0];
  const bool changed = first != 0;
  std::string verdict =
      changed ? absl::StrFormat(
                    "the simulation changes the ranking: candidate %d simulates fastest (%.4g s a step, "
                    "against %.4g s for the planner's first)",
                    first + 1, rows[first].simulated, rows[0].simulated)
              : absl::StrFormat("the simulation keeps the planner's first candidate (%.4g s a step simulated)",
                                rows[0].simulated);
  if (o.json) {
    auto j = nlohmann::json::parse(partitioner::PlanJson(rows[first].plan, graph));
    nlohmann::json cands = nlohmann::json::array();
    for (size_t i = 0; i < rows.size(); ++i)
      cands.push_back({{"layout", LayoutText(rows[i].candidate, profile)},
                       {"predicted_seconds", rows[i].candidate.predicted_seconds},
                       {"simulated_seconds", rows[i].simulated},
                       {"simulated_rank", rank[i]}});
    j["simulated_candidates"] = cands;
    j["ranking_changed"] = changed;
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::cout << partitioner::PlanTable(rows[first].plan, graph, profile) << "\n";
  std::cout << absl::StrFormat("%-4s %12s %12s %9s  %s\n", "#", "predicted_s", "simulated_s", "sim_rank", "layout");
  for (size_t i = 0; i < rows.size(); ++i)
    std::cout << absl::StrFormat("%-4d %12.4g %12.4g %9d  %s\n", i + 1, rows[i].candidate.predicted_seconds,
                                 rows[i].simulated, rank[i], LayoutText(rows[i].candidate, profile));
  std::cout << verdict << "\n";
  return 0;
}

}  // namespace

int RunPlanCommand(const PlanCommandOptions& o) {
  absl::StatusOr<partitioner::OpGraph> graph;
  absl::StatusOr<partitioner::ClusterProfile> profile;
  if (o.live) {
    if (o.coordinator.empty() || o.certs_dir.empty()) {
      std::cerr << "meridian plan: --live needs --coordinator HOST:PORT and --certs DIR\n";
      return 2;
    }
    auto run = InspectCoordinator(o.coordinator, o.certs_dir, o.identity);
    if (!run.ok()) {
      std::cerr << "meridian plan: " << run.status().message() << "\n";
      return run.status().code() == absl::StatusCode::kFailedPrecondition ? 2 : 1;
    }
    if (run->profile_json.empty() || run->graph_json.empty()) {
      std::cerr << "meridian plan: coordinator at " << o.coordinator << ": the sites have not been measured yet\n";
      return 1;
    }
    graph = partitioner::ParseGraphJson(run->graph_json, "graph.json from " + o.coordinator);
    profile = partitioner::ParseProfileJson(run->profile_json, "profile.json from " + o.coordinator);
  } else {
    if (o.graph_path.empty() || o.profile_path.empty()) {
      std::cerr << "meridian plan: --graph and --profile are required (or --live)\n";
      return 2;
    }
    graph = partitioner::LoadGraphFile(o.graph_path);
    profile = partitioner::LoadProfileFile(o.profile_path);
  }
  if (!graph.ok()) {
    std::cerr << "meridian plan: " << graph.status().message() << "\n";
    return 2;
  }
  if (!profile.ok()) {
    std::cerr << "meridian plan: " << profile.status().message() << "\n";
    return 2;
  }
  if (o.step_overlap > 0 && o.step_overlap >= o.micro_batches) {
    std::cerr << "meridian plan: --step-overlap " << o.step_overlap << " must be below --micro-batches "
              << o.micro_batches << "\n";
    return 2;
  }
  partitioner::PlanOptions po;
  po.micro_batches = o.micro_batches;
  po.ratio = o.ratio;
  po.replication = !o.reference && !o.no_replication;
  po.recompute = !o.reference && !o.no_recompute;
  po.adaptive_compression = !o.reference && !o.ratio_given;
  po.deep_pipeline = !o.reference;
  if (o.revisit_fraction > 0) po.link_codecs = partitioner::DefaultLinkCodecs(o.revisit_fraction);
  po.force_heuristic = o.force_heuristic;
  po.zero = o.zero;
  po.step_overlap = o.step_overlap;
  auto plan = partitioner::PlanPipeline(*graph, *profile, po);
  if (!plan.ok()) {
    std::cerr << "meridian plan: " << plan.status().message() << "\n";
    return 2;
  }
  if (o.simulate > 0) return SimulateCandidates(o, *graph, *profile, po, *plan);
  if (o.json)
    std::cout << partitioner::PlanJson(*plan, *graph);
  else
    std::cout << partitioner::PlanTable(*plan, *graph, *profile);
  if (!o.dot_path.empty()) {
    std::ofstream dot(o.dot_path);
    dot << partitioner::PlanDot(*plan, *graph);
    if (!dot) {
      std::cerr << "meridian plan: " << o.dot_path << ": cannot write\n";
      return 1;
    }
  }
  return 0;
}

void AddGraphOptions(CLI::App* cmd, GraphCommandOptions* o) {
  cmd->add_option("--config", o->config_path, "HF config.json of a LLaMA-architecture model")->required();
  cmd->add_option("--micro-batch-size", o->micro_batch_size, "Sequences per micro-batch")
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--seq-len", o->sequence_length, "Tokens per sequence")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--out", o->out_path, "Output graph.json (default: stdout)");
}

int RunGraphCommand(const GraphCommandOptions& o) {
  auto config = core::ReadFile(o.config_path);
  if (!config.ok()) {
    std::cerr << "meridian graph: " << config.status().message() << "\n";
    return 2;
  }
  auto shape = partitioner::ParseLlamaConfig(*config, o.config_path);
  if (!shape.ok()) {
    std::cerr << "meridian graph: " << shape.status().message() << "\n";
    return 2;
  }
  partitioner::LlamaGraphOptions go;
  go.micro_batch_size = o.micro_batch_size;
  go.sequence_length = o.sequence_length;
  std::string text = partitioner::GraphToJson(partitioner::BuildLlamaGraph(*shape, go));
  if (o.out_path.empty()) {
    std::cout << text;
    return 0;
  }
  std::ofstream out(o.out_path);
  out << text;
  if (!out) {
    std::cerr << "meridian graph: " << o.out_path << ": cannot write\n";
    return 1;
  }
  return 0;
}

}  // namespace meridian::coordinator
