// Planner benchmarks: planning time at scale, and the heuristic's gap to the exact planner.
//   build/bench/partitioner_bench                       (all)
//   build/bench/partitioner_bench --benchmark_filter=Large
#include <benchmark/benchmark.h>

#include <algorithm>
#include <random>

#include "partitioner/planner.h"

namespace {

using namespace meridian::partitioner;

struct Instance {
  OpGraph graph;
  ClusterProfile profile;
};

// n heterogeneous sites (speeds over a 10x range, 24-80 GB), fully linked with 20 Mbit/s - 10 Gbit/s
// links, and a chain of `ops` transformer-like ops of varying cost.
Instance Make(int n, int ops, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(0, 1);
  Instance in;
  for (int i = 0; i < ops; ++i) {
    Op op{"op" + std::to_string(i), 1e11 * (0.5 + u(rng)), 0, 2e8 * u(rng), 6e8 * u(rng), 1.6e7, {}};
    op.backward_flops = 2 * op.forward_flops;
    if (i) op.inputs = {i - 1};
    in.graph.ops.push_back(op);
  }
  for (int s = 0; s < n; ++s)
    in.profile.sites.push_back({"s" + std::to_string(s), 1e13 * (1 + 9 * u(rng)), 24e9 + 56e9 * u(rng), {}});
  for (int a = 0; a < n; ++a)
    for (int b = 0; b < n; ++b)
      if (a != b)
        in.profile.links.push_back({in.profile.sites[a].name, in.profile.sites[b].name, 2.5e6 * std::pow(500.0, u(rng)),
                                    0.001 + 0.1 * u(rng)});
  return in;
}

void BM_PlanLarge(benchmark::State& state) {
  Instance in = Make(static_cast<int>(state.range(0)), static_cast<int>(state.range(1)), 1);
  PlanOptions o;
  o.micro_batches = 32;
  for (auto _ : state) {
    auto plan = PlanPipeline(in.graph, in.profile, o);
    if (!plan.ok()) state.SkipWithError(std::string(plan.status().message()).c_str());
    benchmark::DoNotOptimize(plan);
  }
}
BENCHMARK(BM_PlanLarge)->Args({256, 1024})->Args({64, 256})->Unit(benchmark::kMillisecond)->Iterations(3);

void BM_PlanExact(benchmark::State& state) {
  Instance in = Make(static_cast<int>(state.range(0)), static_cast<int>(state.range(1)), 2);
  PlanOptions o;
  o.micro_batches = 32;
  for (auto _ : state) benchmark::DoNotOptimize(PlanPipeline(in.graph, in.profile, o));
}
BENCHMARK(BM_PlanExact)->Args({8, 66})->Args({8, 128})->Args({6, 256})->Unit(benchmark::kMillisecond)->Iterations(3);

// The heuristic's predicted step time over the exact optimum, on random 4-8-site instances.
void BM_HeuristicGap(benchmark::State& state) {
  double sum_gap = 0, worst = 0;
  int count = 0, optimal = 0, missed = 0;
  for (auto _ : state) {
    for (unsigned seed = 0; seed < 100; ++seed) {
      Instance in = Make(4 + seed % 5, 32 + seed % 33, 1000 + seed);
      PlanOptions o;
      o.micro_batches = 4 + seed % 29;
      auto exact = PlanPipeline(in.graph, in.profile, o);
      o.force_heuristic = true;
      auto heur = PlanPipeline(in.graph, in.profile, o);
      if (!exact.ok()) continue;
      if (!heur.ok()) {
        ++missed;
        continue;
      }
      double gap = heur->predicted_step_seconds / exact->predicted_step_seconds - 1;
      sum_gap += gap;
      worst = std::max(worst, gap);
      optimal += gap < 1e-9;
      ++count;
    }
  }
  state.counters["instances"] = count;
  state.counters["mean_gap_pct"] = 100 * sum_gap / std::max(count, 1);
  state.counters["worst_gap_pct"] = 100 * worst;
  state.counters["optimal_pct"] = 100.0 * optimal / std::max(count, 1);
  state.counters["heuristic_infeasible"] = missed;
}
BENCHMARK(BM_HeuristicGap)->Iterations(1)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
