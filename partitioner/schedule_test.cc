#include "partitioner/schedule.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>

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

// PipelineTimes::step_overlap: a steady step of consecutive overlapped steps, each stage's optimizer step
// in it. One stage runs its passes back to back: a step is its M micro-batches' passes and its optimizer
// step, whatever the overlap.
TEST(ScheduleSimulation, OverlappedStepsOfOneStageAreItsPassesAndItsOptimizerStep) {
  PipelineTimes t = Uniform(1, 6, 1.0, 2.0, 0, 0);
  t.optimizer_seconds = {0.5};
  for (int k : {1, 3, 5}) {
    t.step_overlap = k;
    SimulatedStep s = SimulatePipeline(t);
    ASSERT_FALSE(s.deadlocked);
    EXPECT_DOUBLE_EQ(s.step_seconds, 6 * 3.0 + 0.5) << "K " << k;
    EXPECT_DOUBLE_EQ(s.busy_seconds[0], 6 * 3.0);
    EXPECT_DOUBLE_EQ(s.wait_seconds[0], 0.0);
  }
}

// A balanced pipeline over free links: an exact step pays 1F1B's fill and drain, (M + S - 1) passes and
// the optimizer step. With S early micro-batches (or more) each stage runs a step's M passes and its
// optimizer step back to back, the boundary hidden. With S - 1 the last stage still waits one forward pass
// at each boundary: the step's first micro-batch after the early ones begins at stage 0 only after its
// optimizer step, and the early ones cover the rest of the way down.
TEST(ScheduleSimulation, OverlapHidesABalancedPipelinesFillAndDrain) {
  for (int S : {2, 3, 4}) {
    PipelineTimes t = Uniform(S, 12, 1.0, 2.0, 0, 0);
    t.optimizer_seconds.assign(S, 0.5);
    const double exact = SimulatePipeline(t).step_seconds + 0.5;
    EXPECT_DOUBLE_EQ(exact, (12 + S - 1) * 3.0 + 0.5);
    t.step_overlap = S - 1;
    EXPECT_DOUBLE_EQ(SimulatePipeline(t).step_seconds, 12 * 3.0 + 1.0 + 0.5) << "S " << S;
    for (int k = S; k <= 6; ++k) {
      t.step_overlap = k;
      SimulatedStep s = SimulatePipeline(t);
      ASSERT_FALSE(s.deadlocked) << "S " << S << " K " << k;
      EXPECT_DOUBLE_EQ(s.step_seconds, 12 * 3.0 + 0.5) << "S " << S << " K " << k;
      for (int st = 0; st < S; ++st) EXPECT_DOUBLE_EQ(s.busy_seconds[st], 12 * 3.0) << "stage " << st;
    }
  }
}

// Over long latency the exact step pays a round trip at its boundary (and a deeper window covers the
// round trip within it). The overlapped step hides the boundary's, more of it with more early
// micro-batches: a micro-batch's round trip here (two passes, two transfers, two latencies: 0.8 s) is under
// three of stage 0's passes (0.3 s each), so three hide it and the step is each stage's compute and
// optimizer step.
TEST(ScheduleSimulation, OverlapHidesTheBoundarysRoundTrip) {
  PipelineTimes t = Uniform(2, 16, 0.1, 0.2, 0.05, 0.2);
  t.in_flight = {8, 1};
  t.optimizer_seconds = {0.1, 0.1};
  const double compute = 16 * 0.3 + 0.1;
  const double exact = SimulatePipeline(t).step_seconds + 0.1;
  EXPECT_GT(exact, compute + 2 * 0.2);
  double previous = exact;
  for (int k : {1, 2}) {
    t.step_overlap = k;
    SimulatedStep s = SimulatePipeline(t);
    ASSERT_FALSE(s.deadlocked);
    EXPECT_LT(s.step_seconds, previous - 0.1) << "K " << k;
    EXPECT_GT(s.step_seconds, compute + 0.1) << "K " << k;
    EXPECT_GT(s.wait_seconds[0], 0.1) << "K " << k;
    previous = s.step_seconds;
  }
  for (int k : {3, 8}) {
    t.step_overlap = k;
    SimulatedStep s = SimulatePipeline(t);
    ASSERT_FALSE(s.deadlocked);
    EXPECT_NEAR(s.step_seconds, compute, 1e-9) << "K " << k;
    EXPECT_NEAR(s.wait_seconds[0], 0.0, 1e-9) << "K " << k;
    EXPECT_NEAR(s.busy_seconds[0], 16 * 0.3, 1e-9) << "K " << k;
  }
}

// Replicated stages and recomputation run their overlapped steps too: every pass once a step.
TEST(ScheduleSimulation, OverlappedStepsOfReplicasRunEachPassOnce) {
  PipelineTimes t = Uniform(2, 8, 0.1, 0.2, 0.01, 0.05);
  t.owners = {{}, {0, 1, 0, 1, 0, 1, 0, 1}};
  t.replica_scale = {{}, {2.0, 2.0}};  // each replica at half the stage's combined pace
  t.recompute_seconds = {0.1, 0.0};
  t.step_overlap = 3;
  t.in_flight = {4, 2};
  SimulatedStep s = SimulatePipeline(t);
  ASSERT_FALSE(s.deadlocked);
  // In the reported step stage 0 runs 8 forward passes (some of them the next step's), 8 recomputations
  // and 8 backward passes; each replica of stage 1 its 4 micro-batches' at twice the time.
  EXPECT_NEAR(s.busy_seconds[0], 8 * 0.4, 1e-9);
  EXPECT_NEAR(s.busy_seconds[1], 4 * 0.3 * 2.0, 1e-9);
  std::map<char, int> kinds;
  for (const auto& p : s.passes[0]) ++kinds[p.kind];
  EXPECT_EQ(kinds['F'], 8);
  EXPECT_EQ(kinds['R'], 8);
  EXPECT_EQ(kinds['B'], 8);
  EXPECT_GE(s.step_seconds, 8 * 0.4 - 1e-9);
}

// A replicated stage's replicas each do their own micro-batches' frame work (codecs, transport) in full:
// it does not scale with a replica's share of the stage's compute, as its passes do.
TEST(ScheduleSimulation, ReplicasDoTheirFramesWorkInFull) {
  PipelineTimes t = Uniform(2, 8, 0.1, 0.2, 0.0, 0.0);
  t.owners = {{0, 1, 0, 1, 0, 1, 0, 1}, {}};
  t.replica_scale = {{2.0, 2.0}, {}};  // each replica at half the stage's combined pace
  t.forward_frame_seconds = {0.01, 0.03};
  t.backward_frame_seconds = {0.02, 0.04};
  SimulatedStep s = SimulatePipeline(t);
  ASSERT_FALSE(s.deadlocked);
  // Each replica of stage 0: 4 micro-batches of (0.1 + 0.2) x 2 and 0.03 of frames each.
  EXPECT_NEAR(s.busy_seconds[0], 4 * (0.6 + 0.03), 1e-9);
  // Stage 1: 8 of 0.3 and 0.07 each.
  EXPECT_NEAR(s.busy_seconds[1], 8 * (0.3 + 0.07), 1e-9);
}

TEST(Schedule, StepOverlapWithoutEarlyMicroBatchesIsPipelineSchedule) {
  for (int stage : {0, 1, 2}) {
    std::vector<StepEntry> want;
    for (auto [kind, mb] : PipelineSchedule(stage, 3, 6, 4 - stage)) want.push_back({kind, mb, false});
    EXPECT_EQ(OverlappedStepSchedule(stage, 3, 6, 4 - stage, 0, 0), want);
  }
}

// "F0 B0 F1' ...": a forward / backward pass of a micro-batch, primed for the next step's.
std::vector<StepEntry> Entries(const std::string& text) {
  std::vector<StepEntry> out;
  std::istringstream in(text);
  for (std::string e; in >> e;) out.push_back({e[0], std::stoi(e.substr(1)), e.back() == '\''});
  return out;
}

TEST(Schedule, StepOverlapStartsTheNextStepsFirstMicroBatchesInTheDrain) {
  // Stage 0 of 2, 6 micro-batches, depth 3, 2 early: the next step's forwards fill the drain, 1F1B on.
  EXPECT_EQ(OverlappedStepSchedule(0, 2, 6, 3, 0, 2), Entries("F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F0' B4 F1' B5"));
  // The step after: its first two forwards were run; it keeps three in flight from its start.
  EXPECT_EQ(OverlappedStepSchedule(0, 2, 6, 3, 2, 0), Entries("F2 B0 F3 B1 F4 B2 F5 B3 B4 B5"));
  // The last stage runs the early micro-batches' forward and backward passes but the last one's backward.
  EXPECT_EQ(OverlappedStepSchedule(1, 2, 3, 1, 0, 2), Entries("F0 B0 F1 B1 F2 B2 F0' B0' F1'"));
  EXPECT_EQ(OverlappedStepSchedule(1, 2, 3, 1, 2, 0), Entries("B1 F2 B2"));
}

TEST(Schedule, EarlyMicroBatchesLeaveExactTheFirstStepAndThoseAfterACheckpointOrASync) {
  std::vector<int> got;
  for (int step = 0; step <= 12; ++step) got.push_back(EarlyMicroBatches(3, step, 12, 4, 6));
  // Exact: step 0, steps 4 and 8 (after checkpoint steps), 6 (after a sync), 12 (past the run).
  EXPECT_EQ(got, (std::vector<int>{0, 3, 3, 3, 0, 3, 0, 3, 0, 3, 3, 3, 0}));
  EXPECT_EQ(EarlyMicroBatches(0, 5, 12, 0, 0), 0);
  EXPECT_EQ(EarlyMicroBatches(2, 5, 12, 0, 0), 2);
}

// Runs `steps` steps of an S-stage pipeline whose stages run OverlappedStepSchedule, as the executors
// do: a forward pass needs the previous stage's, a backward pass the next stage's and its own forward;
// after its last backward pass of a step a stage joins the norm's first half (the partial sums, last stage
// to first), and after its part of the step the second half (the total, first to last) and its optimizer
// step, before the next step's part. Returns false on a deadlock. Checks each pass runs once, the depth,
// and that a step's early micro-batches finish their backward passes before the next step's first
// forward pass at each stage.
bool RunOverlapped(int S, int M, const std::vector<int>& depth, int K, int steps, std::string* why) {
  auto early = [&](int step) { return step > 0 && step < steps && step % 3 != 2 ? K : 0; };
  // Per stage: its entries of every step, with a marker for the norm's halves.
  struct Item {
    char kind;  // F, B, 1 (partial sums), 2 (total + optimizer step)
    int step, mb;
  };
  std::vector<std::vector<Item>> seq(S);
  for (int k = 0; k < S; ++k)
    for (int t = 0; t < steps; ++t) {
      auto part = OverlappedStepSchedule(k, S, M, depth[k], early(t), early(t + 1));
      int last_b = -1;
      for (int i = 0; i < static_cast<int>(part.size()); ++i)
        if (part[i].kind == 'B' && !part[i].next) last_b = i;
      for (int i = 0; i < static_cast<int>(part.size()); ++i) {
        seq[k].push_back({part[i].kind, t + (part[i].next ? 1 : 0), part[i].micro_batch});
        if (i == last_b) seq[k].push_back({'1', t, -1});
      }
      seq[k].push_back({'2', t, -1});
    }
  std::set<std::tuple<int, char, int, int>> done;  // (stage, kind, step, mb)
  std::vector<size_t> pos(S, 0);
  std::vector<std::set<std::pair<int, int>>> open(S);  // forwarded, not yet backward
  bool progress = true;
  while (progress) {
    progress = false;
    for (int k = 0; k < S; ++k) {
      while (pos[k] < seq[k].size()) {
        const Item& it = seq[k][pos[k]];
        bool ready = true;
        if (it.kind == 'F') ready = k == 0 || done.count({k - 1, 'F', it.step, it.mb});
        if (it.kind == 'B') ready = k == S - 1 || done.count({k + 1, 'B', it.step, it.mb});
        if (it.kind == '1') ready = k == S - 1 || done.count({k + 1, '1', it.step, -1});
        if (it.kind == '2') ready = k == 0 || done.count({k - 1, '2', it.step, -1});
        if (!ready) break;
        if (!done.insert({k, it.kind, it.step, it.mb}).second) {
          *why = "a pass ran twice";
          return false;
        }
        if (it.kind == 'F') {
          if (it.step > 0 && early(it.step) > it.mb) {  // an early micro-batch: its step's earlier ones done
            for (const auto& [s, mb] : open[k])
              if (s < it.step && mb < early(s)) {
                *why = "an early micro-batch of step " + std::to_string(s) + " still open at the next's forward";
                return false;
              }
          }
          open[k].insert({it.step, it.mb});
          if (static_cast<int>(open[k].size()) > depth[k]) {
            *why = "deeper than in_flight at stage " + std::to_string(k);
            return false;
          }
        }
        if (it.kind == 'B') open[k].erase({it.step, it.mb});
        ++pos[k];
        progress = true;
      }
    }
  }
  for (int k = 0; k < S; ++k)
    if (pos[k] != seq[k].size()) {
      *why = "deadlock at stage " + std::to_string(k);
      return false;
    }
  for (int k = 0; k < S; ++k)
    for (int t = 0; t < steps; ++t)
      for (int m = 0; m < M; ++m)
        if (!done.count({k, 'F', t, m}) || !done.count({k, 'B', t, m})) {
          *why = "a pass never ran";
          return false;
        }
  return true;
}

TEST(Schedule, StepOverlapRunsEveryPassOnceWithinItsDepthAndCannotDeadlock) {
  int tried = 0;
  for (int S : {1, 2, 3, 4})
    for (int M : {2, 4, 7, 12})
      for (int d0 = S; d0 <= M; ++d0)
        for (int K = 1; K < M; ++K) {
          if (d0 > MaxInFlightForOverlap(M, K)) continue;
          std::vector<int> depth(S);
          for (int k = 0; k < S; ++k) depth[k] = std::max(S - k, d0 - 2 * k);  // never increasing
          std::string why;
          EXPECT_TRUE(RunOverlapped(S, M, depth, K, 6, &why))
              << "S " << S << " M " << M << " depth0 " << d0 << " K " << K << ": " << why;
          ++tried;
        }
  EXPECT_GT(tried, 100);
}

TEST(Schedule, StepOverlapBeyondItsDepthLeavesAnEarlyMicroBatchOpen) {
  // The check above can fail: one micro-batch more than MaxInFlightForOverlap allows.
  std::string why;
  EXPECT_FALSE(RunOverlapped(2, 6, {MaxInFlightForOverlap(6, 3) + 1, 1}, 3, 6, &why));
  EXPECT_NE(why.find("still open"), std::string::npos) << why;
}

}  // namespace
}  // namespace meridian::partitioner
