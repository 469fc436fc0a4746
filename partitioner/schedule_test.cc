#include "partitioner/schedule.h"

#include <gtest/gtest.h>

#include <map>
#include <set>

namespace meridian::partitioner {
namespace {

// S stages of equal passes, links with the given transfer and latency both ways.
PipelineTimes Uniform(int S, int M, double f, double b, double transfer, double latency) {
  PipelineTimes t;
  t.micro_batches = M;
  t.forward_seconds.assign(S, f);
  t.backward_seconds.assign(S, b);
  t.forward_transfer_seconds.assign(S - 1, transfer);
  t.backward_transfer_seconds.assign(S - 1, transfer);
  t.forward_latency_seconds.assign(S - 1, latency);
  t.backward_latency_seconds.assign(S - 1, latency);
  return t;
}

TEST(Schedule, DefaultIsOneFOneB) {
  // Stage 0 of 3 with 4 micro-batches: two warm-up forwards, then alternate, then drain.
  using E = std::pair<char, int>;
  EXPECT_EQ(PipelineSchedule(0, 3, 4),
            (std::vector<E>{{'F', 0}, {'F', 1}, {'F', 2}, {'B', 0}, {'F', 3}, {'B', 1}, {'B', 2}, {'B', 3}}));
  EXPECT_EQ(PipelineSchedule(2, 3, 4),
            (std::vector<E>{{'F', 0}, {'B', 0}, {'F', 1}, {'B', 1}, {'F', 2}, {'B', 2}, {'F', 3}, {'B', 3}}));
  EXPECT_EQ(PipelineSchedule(0, 3, 4, 3), PipelineSchedule(0, 3, 4));
}

TEST(Schedule, KeepsExactlyInFlightMicroBatchesAndRunsEachPassOnce) {
  for (int M : {1, 3, 8, 13})
    for (int depth = 1; depth <= M + 2; ++depth) {
      auto s = PipelineSchedule(0, 2, M, depth);
      ASSERT_EQ(s.size(), 2u * M);
      std::set<int> forward, open;
      int most = 0, next_f = 0, next_b = 0;
      for (auto [kind, m] : s) {
        if (kind == 'F') {
          EXPECT_EQ(m, next_f++);
          open.insert(m);
        } else {
          EXPECT_EQ(m, next_b++);
          EXPECT_TRUE(open.count(m)) << "backward before forward";
          open.erase(m);
        }
        most = std::max(most, static_cast<int>(open.size()));
      }
      EXPECT_EQ(most, std::min(depth, M)) << "M " << M << " depth " << depth;
    }
}

TEST(Schedule, DeadlockFreeDepthsNeverIncrease) {
  EXPECT_TRUE(InFlightIsDeadlockFree({3, 2, 1}));
  EXPECT_TRUE(InFlightIsDeadlockFree({7, 4, 4, 1}));
  EXPECT_FALSE(InFlightIsDeadlockFree({2, 3, 1}));
  EXPECT_FALSE(InFlightIsDeadlockFree({2, 0}));
}

TEST(ScheduleSimulation, OneStageIsItsPasses) {
  PipelineTimes t = Uniform(1, 5, 1.0, 2.0, 0, 0);
  SimulatedStep s = SimulatePipeline(t);
  ASSERT_FALSE(s.deadlocked);
  EXPECT_DOUBLE_EQ(s.step_seconds, 15.0);
  EXPECT_DOUBLE_EQ(s.busy_seconds[0], 15.0);
  EXPECT_DOUBLE_EQ(s.wait_seconds[0], 0.0);
}

TEST(ScheduleSimulation, FreeLinksGiveOneFOneBsClassicStep) {
  // Equal stages, instant links: (M + S - 1) * (f + b).
  for (int S : {2, 3, 4})
    for (int M : {S, 8}) {
      SimulatedStep s = SimulatePipeline(Uniform(S, M, 1.0, 2.0, 0, 0));
      ASSERT_FALSE(s.deadlocked);
      EXPECT_DOUBLE_EQ(s.step_seconds, (M + S - 1) * 3.0) << S << " stages, " << M << " micro-batches";
    }
}

TEST(ScheduleSimulation, AnIncreasingDepthDeadlocks) {
  PipelineTimes t = Uniform(2, 6, 1, 2, 0.1, 0.1);
  t.in_flight = {1, 3};
  EXPECT_TRUE(SimulatePipeline(t).deadlocked);
}

TEST(ScheduleSimulation, LinksAreFifosAtTheirBandwidthWithLatency) {
  // Two stages, forward-only cost dominated by a slow link: the second stage's first input arrives after
  // one transfer and one latency, later ones one transfer apart.
  PipelineTimes t = Uniform(2, 4, 0.1, 0.0, 1.0, 0.5);
  t.in_flight = {4, 1};
  SimulatedStep s = SimulatePipeline(t);
  ASSERT_FALSE(s.deadlocked);
  std::map<int, double> start;
  for (const auto& p : s.passes[1])
    if (p.kind == 'F') start[p.micro_batch] = p.start;
  EXPECT_DOUBLE_EQ(start[0], 0.1 + 1.0 + 0.5);
  EXPECT_DOUBLE_EQ(start[3], 0.1 + 4 * 1.0 + 0.5);
  EXPECT_DOUBLE_EQ(s.forward_link_busy_seconds[0], 4.0);
}

// Two whole pipelines (stage 0 on sites a0 and b0, stage 1 on a1 and b1; micro-batch m stays in pipeline
// m % 2) over link-bound hops: a0 -> a1 and b0 -> b1 are separate links, so the step is that of one
// pipeline alone on its half of the micro-batches, not of both queued on one link.
TEST(ScheduleSimulation, EachPairOfReplicasHasLinksOfItsOwn) {
  PipelineTimes both = Uniform(2, 8, 0.1, 0.2, 1.0, 0.5);
  both.in_flight = {8, 1};
  both.owners = {{0, 1, 0, 1, 0, 1, 0, 1}, {0, 1, 0, 1, 0, 1, 0, 1}};
  // Each replica's passes take twice the stage's combined pace per micro-batch.
  both.replica_scale = {{2, 2}, {2, 2}};
  PipelineTimes one = Uniform(2, 4, 0.2, 0.4, 1.0, 0.5);
  one.in_flight = {8, 1};
  const SimulatedStep s = SimulatePipeline(both), alone = SimulatePipeline(one);
  ASSERT_FALSE(s.deadlocked);
  EXPECT_DOUBLE_EQ(s.step_seconds, alone.step_seconds);
  EXPECT_DOUBLE_EQ(s.forward_link_busy_seconds[0], 8.0);  // both pairs' transfers
  // The link paces the step: four transfers per pair, not eight on one FIFO.
  EXPECT_LT(s.step_seconds, 8 * 1.0);
}

// A recomputed forward pass needs no gradient: it runs as soon as the stage is free, so it costs nothing
// while the gradient is still on its way, and delays the backward pass only by what it takes beyond that.
TEST(ScheduleSimulation, RecomputationRunsWhileTheGradientIsOnItsWay) {
  PipelineTimes t = Uniform(2, 1, 1.0, 1.0, 0, 2.0);  // the gradient is back at stage 0 at t = 7
  const SimulatedStep plain = SimulatePipeline(t);
  t.recompute_seconds = {5.0, 0};
  SimulatedStep s = SimulatePipeline(t);
  ASSERT_FALSE(s.deadlocked);
  ASSERT_EQ(s.passes[0].size(), 3u);
  EXPECT_EQ(s.passes[0][1].kind, 'R');
  EXPECT_DOUBLE_EQ(s.passes[0][1].start, 1.0);
  EXPECT_DOUBLE_EQ(s.passes[0][1].end, 6.0);
  EXPECT_DOUBLE_EQ(s.passes[0][2].start, 7.0);  // B, when its gradient arrives
  EXPECT_DOUBLE_EQ(s.step_seconds, plain.step_seconds);
  EXPECT_DOUBLE_EQ(s.busy_seconds[0], plain.busy_seconds[0] + 5.0);
  EXPECT_DOUBLE_EQ(s.wait_seconds[0], plain.wait_seconds[0] - 5.0);
  t.recompute_seconds = {7.0, 0};  // one second beyond the gradient's arrival
  EXPECT_DOUBLE_EQ(SimulatePipeline(t).step_seconds, plain.step_seconds + 1.0);
}

TEST(ScheduleSimulation, DeeperPipelineCoversALongRoundTrip) {
  // The WAN-bound case: hops as long as a stage's pass, long latency. 1F1B's window starves
  // the early stages; the chosen depths bring the step near M passes of the slowest stage.
  PipelineTimes t = Uniform(3, 32, 0.07, 0.14, 0.17, 0.04);
  const double one_f_one_b = SimulatePipeline(t).step_seconds;
  std::vector<int> depth = ChooseInFlight(t, {32, 32, 32});
  EXPECT_TRUE(InFlightIsDeadlockFree(depth));
  EXPECT_GT(depth[0], 3);
  EXPECT_EQ(depth[2], 1);
  t.in_flight = depth;
  const double deep = SimulatePipeline(t).step_seconds;
  const double compute = 32 * 0.21;
  EXPECT_LT(deep, 0.8 * one_f_one_b);
  EXPECT_LT(deep, 1.25 * compute) << "depths " << depth[0] << "/" << depth[1] << "/" << depth[2];
  EXPECT_GT(one_f_one_b, 1.5 * compute);
}

TEST(ScheduleSimulation, DepthStaysWithinMemory) {
  PipelineTimes t = Uniform(3, 32, 0.07, 0.14, 0.17, 0.04);
  std::vector<int> depth = ChooseInFlight(t, {5, 32, 1});
  EXPECT_LE(depth[0], 5);
  EXPECT_TRUE(InFlightIsDeadlockFree(depth));
  EXPECT_GE(depth[0], 3);
  EXPECT_GE(depth[1], 2);
}

TEST(ScheduleSimulation, ComputeBoundPipelinesKeepOneFOneB) {
  // Links far faster than compute: nothing to cover, and the shallowest depth wins ties.
  PipelineTimes t = Uniform(3, 8, 1.0, 2.0, 0.001, 0.0001);
  EXPECT_EQ(ChooseInFlight(t, {8, 8, 8}), (std::vector<int>{3, 2, 1}));
}

}  // namespace
}  // namespace meridian::partitioner
