#include "simulator/simulator.h"

#include <filesystem>
#include <fstream>
#include <random>

#include "simulator/failures.h"
#include "simulator/fleet.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "partitioner/schedule.h"

namespace meridian::simulator {
namespace {

using partitioner::ClusterProfile;
using partitioner::OpGraph;
using partitioner::Plan;

// `ops` ops in a chain, each 1 GFLOP forward and 2 backward, `out` bytes of output, 1 MB of parameters.
OpGraph Chain(int ops, double out = 1e6) {
  OpGraph g;
  for (int i = 0; i < ops; ++i) {
    partitioner::Op op;
    op.name = "op" + std::to_string(i);
    op.forward_flops = 1e9;
    op.backward_flops = 2e9;
    op.param_bytes = 1e6;
    op.optimizer_bytes = 2e6;  // it trains: its gradients are summed (partitioner::GradientBytes)
    op.output_bytes = out;
    if (i > 0) op.inputs = {i - 1};
    g.ops.push_back(op);
  }
  return g;
}

// `n` sites of `flops` each, every pair linked both ways at `bandwidth` bytes/s and `latency` s one way.
ClusterProfile Sites(int n, double flops, double bandwidth, double latency) {
  ClusterProfile p;
  for (int i = 0; i < n; ++i) p.sites.push_back({"s" + std::to_string(i), flops, 1e12, {}, {}});
  for (int a = 0; a < n; ++a)
    for (int b = 0; b < n; ++b)
      if (a != b) p.links.push_back({p.sites[a].name, p.sites[b].name, bandwidth, latency});
  return p;
}

// A pipeline over sites 0..S-1 with equal op ranges, or with the given stage sites (replicas).
Plan Pipeline(const OpGraph& g, const ClusterProfile& p, int micro_batches, std::vector<std::vector<int>> sites,
              const std::string& codec = "identity") {
  Plan plan;
  plan.micro_batches = micro_batches;
  const int S = static_cast<int>(sites.size());
  const auto last = partitioner::EvenCuts(static_cast<int>(g.ops.size()), S);
  for (int k = 0; k < S; ++k) {
    partitioner::StagePlan st;
    st.sites = sites[k];
    for (int s : sites[k]) st.site_names.push_back(p.sites[s].name);
    st.first_op = k == 0 ? 0 : last[k - 1] + 1;
    st.last_op = last[k];
    std::vector<double> equal(sites[k].size(), 1.0);
    st.micro_batches = partitioner::ShareMicroBatches(micro_batches, equal);
    if (sites[k].size() > 1) st.gradient_codec = "identity";
    plan.stages.push_back(st);
  }
  for (int k = 0; k + 1 < S; ++k) {
    partitioner::LinkPlan l;
    l.from_stage = k;
    l.bytes = g.ops[last[k]].output_bytes;
    l.codec = codec;
    l.ratio = partitioner::PriceCodec(codec)->ratio;
    plan.links.push_back(l);
  }
  return plan;
}

TEST(SimulatorTest, OneStageIsMicroBatchesTimesItsPass) {
  const OpGraph g = Chain(4);
  const ClusterProfile p = Sites(1, 1e12, 1e9, 0);
  const Plan plan = Pipeline(g, p, 8, {{0}});
  auto r = Simulate(g, p, plan);
  ASSERT_TRUE(r.ok()) << r.status();
  const double pass = 4 * 3e9 / 1e12;  // forward + backward of 4 ops
  EXPECT_NEAR(r->step_seconds, 8 * pass, 1e-9);
  EXPECT_NEAR(r->step_times[0], 8 * pass, 1e-9);
  EXPECT_NEAR(r->utilisation, 1.0, 1e-9);
  EXPECT_NEAR(r->bubble_fraction, 0.0, 1e-9);
  ASSERT_EQ(r->sites.size(), 1u);
  EXPECT_NEAR(r->sites[0].compute_seconds, 8 * pass, 1e-9);
  EXPECT_NEAR(r->sites[0].wait_seconds, 0.0, 1e-9);
}

TEST(SimulatorTest, BalancedPipelineWithFreeLinksTakesMicroBatchesPlusStagesMinusOnePasses) {
  for (int S : {2, 3, 4})
    for (int M : {1, 4, 8, 16}) {
      const OpGraph g = Chain(2 * S);
      const ClusterProfile p = Sites(S, 1e12, 1e18, 0);
      std::vector<std::vector<int>> sites;
      for (int k = 0; k < S; ++k) sites.push_back({k});
      auto r = Simulate(g, p, Pipeline(g, p, M, sites));
      ASSERT_TRUE(r.ok()) << r.status();
      const double t = 2 * 3e9 / 1e12;  // a stage's forward + backward per micro-batch
      EXPECT_NEAR(r->step_times[0], (M + S - 1) * t, 1e-6) << "S=" << S << " M=" << M;
      EXPECT_NEAR(r->step_seconds, (M + S - 1) * t, 1e-6) << "S=" << S << " M=" << M;
      // The reference cost model is exact here.
      std::vector<int> order, last = partitioner::EvenCuts(2 * S, S);
      for (int k = 0; k < S; ++k) order.push_back(k);
      EXPECT_NEAR(r->step_seconds, partitioner::ReferenceStepTime(g, p, M, 1.0, order, last), 1e-6);
      EXPECT_NEAR(r->bubble_fraction, (S - 1.0) / (M + S - 1.0), 1e-6);
    }
}

// job.step_overlap (plan.json "step_overlap"): the next step's first micro-batches begin in this step's
// drain, as the executors run them (partitioner::OverlappedStepSchedule), so the step boundary's round
// trip is hidden: on a latency-bound two-stage pipeline the exact steps each pay it, the overlapped ones
// run within a few percent of the stages' compute.
TEST(SimulatorTest, StepOverlapHidesTheStepBoundarysRoundTrip) {
  const OpGraph g = Chain(4);
  const ClusterProfile p = Sites(2, 1e12, 1e18, 0.01);  // free bandwidth, 10 ms one way
  const int M = 16;
  Plan plan = Pipeline(g, p, M, {{0}, {1}});
  plan.stages[0].in_flight = 8;  // covers the round trip (two passes and two latencies: 4-5 micro-batches)
  SimulationOptions o;
  o.steps = 6;
  auto exact = Simulate(g, p, plan, o);
  ASSERT_TRUE(exact.ok()) << exact.status();
  // 4 early micro-batches fill half of stage 0's drain (a 2 ms gap per backward pass there: the next stage
  // runs a forward and a backward pass per micro-batch, stage 0 only the backward); 8 fill it.
  plan.step_overlap = 4;
  auto half = Simulate(g, p, plan, o);
  ASSERT_TRUE(half.ok()) << half.status();
  plan.step_overlap = 8;
  auto overlapped = Simulate(g, p, plan, o);
  ASSERT_TRUE(overlapped.ok()) << overlapped.status();
  const double t = 2 * 3e9 / 1e12;  // a stage's forward + backward per micro-batch
  // Exact: each step pays its fill and drain, about a round trip (2 x 10 ms and a pass each way).
  EXPECT_GT(exact->median_step_seconds, M * t + 0.02);
  EXPECT_LT(half->median_step_seconds, exact->median_step_seconds - 0.01);
  EXPECT_GT(half->median_step_seconds, overlapped->median_step_seconds);
  // Overlapped: the steps after the first run at the stages' compute, within 3%.
  EXPECT_LT(overlapped->median_step_seconds, 1.03 * M * t);
  EXPECT_GE(overlapped->median_step_seconds, M * t - 1e-9);
  // The reported step is a steady one (one more is simulated after it, whose early micro-batches it
  // begins): stage 0 runs its own 8 later forward passes, its 16 backward passes and the next step's 8
  // early forward passes, a step's compute; its timeline (the window from the first site beginning the step
  // to the last ending it) holds those 8 as the next step's, and those stage 0 runs after them while stage 1
  // ends the step.
  ASSERT_EQ(overlapped->sites.size(), 2u);
  EXPECT_NEAR(overlapped->sites[0].compute_seconds, M * t, 1e-9);
  int next_forwards = 0;
  for (const auto& a : overlapped->timeline)
    next_forwards += a.site == "s0" && a.kind == "forward" && a.step == o.steps;
  EXPECT_GE(next_forwards, 8);
  ASSERT_EQ(overlapped->step_times.size(), 6u);
  EXPECT_NEAR(exact->sites[0].compute_seconds, M * t, 1e-9);
  // The first step has no early micro-batches and begins the second's: it is no shorter than an exact step.
  EXPECT_GE(overlapped->step_times[0], exact->step_times[0] - 1e-9);
}

// The planner's schedule simulation (partitioner::SimulatePipeline with step_overlap, which prices the
// plans meridian plan ranks) runs the same overlapped steps as the simulator: on the test above's
// pipeline their steady steps agree from one early micro-batch to every one the depth allows. (An exact
// step, K = 0, the planner prices as one step to the end of the norm's exchange, whose last hop down the
// pipeline the simulator's next step overlaps with its first forward pass: 0.01 s more here.)
TEST(SimulatorTest, ThePlannersOverlappedStepIsTheSimulators) {
  const OpGraph g = Chain(4);
  const ClusterProfile p = Sites(2, 1e12, 1e18, 0.01);
  const int M = 16;
  Plan plan = Pipeline(g, p, M, {{0}, {1}});
  plan.stages[0].in_flight = 8;
  partitioner::PipelineTimes t;
  t.micro_batches = M;
  t.forward_seconds.assign(2, 2 * 1e9 / 1e12);
  t.backward_seconds.assign(2, 2 * 2e9 / 1e12);
  t.forward_transfer_seconds = t.backward_transfer_seconds = {1e6 / 1e18};
  t.forward_latency_seconds = t.backward_latency_seconds = {0.01};
  t.in_flight = {8, 1};
  SimulationOptions o;
  o.steps = 8;
  for (int k : {1, 2, 4, 8}) {
    plan.step_overlap = k;
    t.step_overlap = k;
    auto simulated = Simulate(g, p, plan, o);
    ASSERT_TRUE(simulated.ok()) << simulated.status();
    const partitioner::SimulatedStep planned = partitioner::SimulatePipeline(t);
    ASSERT_FALSE(planned.deadlocked);
    EXPECT_NEAR(planned.step_seconds, simulated->median_step_seconds, 1e-3 * simulated->median_step_seconds)
        << "K " << k;
  }
}

// A CPU site's transport work (profile transport_seconds_per_frame / _per_byte) lengthens each pass that
// sends or receives a frame: in a balanced two-stage pipeline on free links every pass sends or receives
// one, so each stage's pass grows by one frame's work, and the step by (M + 1) of them per direction.
TEST(SimulatorTest, TransportWorkLengthensThePassesThatSendOrReceive) {
  const OpGraph g = Chain(4);
  ClusterProfile p = Sites(2, 1e12, 1e18, 0);
  const double per_frame = 1e-3, per_byte = 2e-9, bytes = 1e6;
  for (auto& s : p.sites) s.transport_seconds_per_frame = per_frame, s.transport_seconds_per_byte = per_byte;
  for (int M : {1, 4, 8}) {
    auto r = Simulate(g, p, Pipeline(g, p, M, {{0}, {1}}));
    ASSERT_TRUE(r.ok()) << r.status();
    const double t = 2 * 3e9 / 1e12, frame = per_frame + per_byte * bytes;  // identity: the wire is the tensor
    EXPECT_NEAR(r->step_seconds, (M + 1) * (t + 2 * frame), 1e-9) << "M=" << M;
    EXPECT_NEAR(r->sites[0].codec_seconds, 0.0, 1e-12);  // transport is not codec work
  }
  // Where a link's receive cost was measured above the site's figure (a slow link's frames trickle in),
  // each frame received over it costs that much a byte: each stage receives one frame per micro-batch.
  const double receive = 6e-9;
  for (auto& l : p.links) l.receive_seconds_per_byte = receive;
  for (int M : {1, 4}) {
    auto r = Simulate(g, p, Pipeline(g, p, M, {{0}, {1}}));
    ASSERT_TRUE(r.ok()) << r.status();
    const double t = 2 * 3e9 / 1e12, sent = per_frame + per_byte * bytes, received = per_frame + receive * bytes;
    EXPECT_NEAR(r->step_seconds, (M + 1) * (t + sent + received), 1e-9) << "M=" << M;
  }
}

// Once a step, after the norm, each stage clips and steps its optimizer on its compute thread: one stage's
// step is its passes plus its optimizer, which is compute, and the timeline shows it. In a pipeline the
// slowest stage's optimizer lengthens the step, less what the next step's fill hides of it.
TEST(SimulatorTest, TheOptimizerStepEndsEachStepOnTheComputeThread) {
  OpGraph g = Chain(4);
  for (auto& op : g.ops) op.optimizer_bytes = 5e5;  // 2e6 bytes of state for the four
  ClusterProfile p = Sites(2, 1e12, 1e18, 0);
  const double t = 4 * 3e9 / 1e12;  // the four ops' passes per micro-batch
  const int M = 4;
  auto plain = Simulate(g, p, Pipeline(g, p, M, {{0}}), {.steps = 3});
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_NEAR(plain->step_seconds, M * t, 1e-9);
  p.sites[0].optimizer_seconds_per_byte = 5e-9;  // 10 ms a step
  auto r = Simulate(g, p, Pipeline(g, p, M, {{0}}), {.steps = 3});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NEAR(r->step_seconds, M * t + 0.010, 1e-9);
  EXPECT_NEAR(r->sites[0].compute_seconds, M * t + 0.010, 1e-9);
  int shown = 0;
  for (const auto& a : r->timeline) shown += a.kind == "optimizer" && a.site == p.sites[0].name;
  EXPECT_GE(shown, 1);
  // Two stages (2 ms and 10 ms of optimizer): longer than without, by at most the slower one.
  p.sites[0].optimizer_seconds_per_byte = 2e-9, p.sites[1].optimizer_seconds_per_byte = 10e-9;
  auto two_plain = Simulate(g, Sites(2, 1e12, 1e18, 0), Pipeline(g, p, M, {{0}, {1}}), {.steps = 3});
  auto two = Simulate(g, p, Pipeline(g, p, M, {{0}, {1}}), {.steps = 3});
  ASSERT_TRUE(two.ok() && two_plain.ok());
  EXPECT_GT(two->step_seconds, two_plain->step_seconds + 0.002);
  EXPECT_LE(two->step_seconds, two_plain->step_seconds + 0.010 + 1e-9);
}

TEST(SimulatorTest, OneSaturatedLinkTakesMicroBatchesTimesItsTransferPlusFill) {
  const int M = 8;
  const double bytes = 4e6, x = 0.5;  // each activation takes 0.5 s on the link
  const OpGraph g = Chain(2, bytes);
  ClusterProfile p = Sites(2, 1e12, 1e18, 0);
  p.links[0].bandwidth_bytes_per_second = bytes / x;  // s0 -> s1 only; gradients travel free
  auto r = Simulate(g, p, Pipeline(g, p, M, {{0}, {1}}));
  ASSERT_TRUE(r.ok()) << r.status();
  const double f = 1e9 / 1e12, b = 2e9 / 1e12;
  // The first forward pass, M transfers back to back, then the last micro-batch's passes after it, and the
  // norm's total down the same link (16 bytes).
  EXPECT_NEAR(r->step_times[0], f + M * x + (f + b) + b + 16 / (bytes / x), 1e-9);
  ASSERT_EQ(r->links.size(), 2u);  // s0 -> s1 (activations, the norm down) and s1 -> s0
  for (const auto& l : r->links) {
    // In the last step's window (from s0 starting it): M activations, the norm's total down at its end,
    // and the previous step's total, which s0 sends as it starts this one.
    if (l.from == "s0") {
      EXPECT_NEAR(l.busy_fraction, (M * x + 2 * 16 / (bytes / x)) / r->last_step_seconds, 1e-9);
    }
  }
}

TEST(SimulatorTest, TwoLinksSharingAnUplinkTakeTwiceAsLong) {
  const int M = 8;
  const double bytes = 4e6, x = 0.5;
  const OpGraph g = Chain(2, bytes);
  ClusterProfile p = Sites(3, 1e14, 1e18, 0);
  for (auto& l : p.links)
    if (l.from == "s0") l.bandwidth_bytes_per_second = bytes / x;
  const Plan plan = Pipeline(g, p, M, {{0}, {1, 2}});  // s0 feeds two replicas, alternately
  auto separate = Simulate(g, p, plan);
  p.sites[0].uplink_bytes_per_second = bytes / x;
  auto shared = Simulate(g, p, plan);
  ASSERT_TRUE(separate.ok()) << separate.status();
  ASSERT_TRUE(shared.ok()) << shared.status();
  // Compute is negligible: the transfers set the step, M/2 per link in parallel, or all M one after another.
  EXPECT_NEAR(separate->step_times[0], M / 2 * x, 0.01);
  EXPECT_NEAR(shared->step_times[0], M * x, 0.01);
  EXPECT_NEAR(shared->step_times[0] / separate->step_times[0], 2.0, 0.01);
}

// Where the planner's schedule simulation applies (no replicas, no codec costs), one step of the event
// simulation equals it: the same 1F1B orders and in-flight depths, the same FIFO links and latencies. The
// norm's control messages take 16 bytes of link time each here, the planner's none.
TEST(SimulatorTest, AgreesWithThePlannersScheduleSimulationOnRandomPipelines) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0, 1);
  for (int trial = 0; trial < 50; ++trial) {
    const int S = 2 + trial % 4, M = 4 + trial % 13;
    const OpGraph g = Chain(2 * S, 1e6 * (0.2 + u(rng)));
    ClusterProfile p = Sites(S, 1e12, 1e7, 0);
    for (auto& s : p.sites) s.flops_per_second = 1e12 * (0.3 + u(rng));
    for (auto& l : p.links) l.bandwidth_bytes_per_second = 1e7 * (0.1 + u(rng)), l.latency_seconds = 0.05 * u(rng);
    std::vector<std::vector<int>> sites;
    for (int k = 0; k < S; ++k) sites.push_back({k});
    Plan plan = Pipeline(g, p, M, sites, trial % 2 ? "int8" : "identity");
    // Deeper pipelines too, never increasing along it.
    for (int k = 0; k < S; ++k)
      plan.stages[k].in_flight = trial % 3 == 0 ? 0 : std::min(M, S - k + (S - k) * (trial % 3));
    // And stages that recompute their activations (the forward pass again before each backward pass).
    for (int k = 0; k < S; ++k) plan.stages[k].recompute = trial % 5 < 2 && (k + trial) % 2 == 0;
    auto r = Simulate(g, p, plan, {.steps = 1});
    ASSERT_TRUE(r.ok()) << r.status();

    partitioner::PipelineTimes t;
    t.micro_batches = M;
    for (int k = 0; k < S; ++k) {
      t.forward_seconds.push_back(2e9 / p.sites[k].flops_per_second);
      t.backward_seconds.push_back(4e9 / p.sites[k].flops_per_second);
      t.recompute_seconds.push_back(plan.stages[k].recompute ? 2e9 / p.sites[k].flops_per_second : 0.0);
      t.in_flight.push_back(plan.stages[k].in_flight > 0 ? plan.stages[k].in_flight : S - k);
    }
    auto bw = [&](int a, int b) {
      for (const auto& l : p.links)
        if (l.from == p.sites[a].name && l.to == p.sites[b].name) return l;
      return partitioner::LinkProfile{};
    };
    double control = 0;
    for (int k = 0; k + 1 < S; ++k) {
      const double x = plan.links[k].bytes * plan.links[k].ratio;
      const double xb = plan.links[k].bytes * partitioner::PriceCodec(plan.links[k].codec)->backward();
      t.forward_transfer_seconds.push_back(x / bw(k, k + 1).bandwidth_bytes_per_second);
      t.forward_latency_seconds.push_back(bw(k, k + 1).latency_seconds);
      t.backward_transfer_seconds.push_back(xb / bw(k + 1, k).bandwidth_bytes_per_second);
      t.backward_latency_seconds.push_back(bw(k + 1, k).latency_seconds);
      control += 16 / bw(k, k + 1).bandwidth_bytes_per_second + 16 / bw(k + 1, k).bandwidth_bytes_per_second;
    }
    const auto planned = partitioner::SimulatePipeline(t);
    ASSERT_FALSE(planned.deadlocked);
    EXPECT_GE(r->step_times[0], planned.step_seconds - 1e-9) << "trial " << trial;
    EXPECT_LE(r->step_times[0], planned.step_seconds + control + 1e-9) << "trial " << trial;
  }
}

TEST(SimulatorTest, ReplicasSumTheirGradientsAfterTheLastBackwardPass) {
  // Two equal replicas of one stage, 8 MB of float32 gradients (16 MB of param_bytes at fraction 0.5), a
  // link of 8 MB/s: the reduce-scatter and the all-gather each send half of it both ways, 0.5 s each.
  OpGraph g = Chain(1);
  g.ops[0].param_bytes = 16e6;
  const ClusterProfile p = Sites(2, 1e12, 8e6, 0);
  Plan plan = Pipeline(g, p, 4, {{0, 1}});
  auto r = Simulate(g, p, plan, {.steps = 2, .bucket_bytes = 1 << 30});
  ASSERT_TRUE(r.ok()) << r.status();
  const double pass = 3e9 / 1e12;
  EXPECT_NEAR(r->step_times[0], 2 * pass + 0.5 + 0.5 + 2 * 16 / 8e6, 1e-6);
  // Buckets handed over during the last backward pass overlap the sum with it.
  auto bucketed = Simulate(g, p, plan, {.steps = 2, .bucket_bytes = 1 << 20});
  ASSERT_TRUE(bucketed.ok());
  EXPECT_LT(bucketed->step_times[0], r->step_times[0]);
  // Not earlier than the last backward pass's start plus the link's 1 s of traffic each way.
  EXPECT_GT(bucketed->step_times[0], 2 * pass - 2e9 / 1e12 + 1.0);
}

TEST(SimulatorTest, TheGradientSumsCodecAndTransportWorkTakesTheSitesCpuWhenTheLinksAreFast) {
  // Two replicas summing 8 MB of gradients as int8, over links fast enough to take no time: the step is the
  // passes plus each replica's CPU work for the sum (partitioner::ReplicaSumCpuSeconds), not the links.
  OpGraph g = Chain(1);
  g.ops[0].param_bytes = 16e6;
  ClusterProfile p = Sites(2, 1e12, 1e15, 0);
  for (auto& s : p.sites) {
    s.codec_bytes_per_second["int8"] = 1e8;
    s.transport_seconds_per_frame = 1e-4;
    s.transport_seconds_per_byte = 1e-9;
  }
  Plan plan = Pipeline(g, p, 4, {{0, 1}});
  plan.stages[0].gradient_codec = "int8";
  auto r = Simulate(g, p, plan, {.steps = 2, .bucket_bytes = 1 << 30});
  ASSERT_TRUE(r.ok()) << r.status();
  const double ratio = partitioner::PriceCodec("int8")->ratio;
  const double cpu = partitioner::ReplicaSumCpuSeconds(p.sites[0], "int8", ratio, 8e6, 2, 1);
  // Encoded 8 MB, decoded 2 x 4 MB and, lossy, the own sum's 4 MB again: 20 MB at 100 MB/s; four frames;
  // 4 x 4 MB x ratio on the wire.
  EXPECT_NEAR(cpu, 20e6 / 1e8 + 4 * 1e-4 + 1e-9 * 16e6 * ratio, 1e-9);
  const double pass = 3e9 / 1e12;
  EXPECT_NEAR(r->step_times[0], 2 * pass + cpu, 1e-3);
  // Identity has no codec work: only the frames' transport.
  plan.stages[0].gradient_codec = "identity";
  auto id = Simulate(g, p, plan, {.steps = 2, .bucket_bytes = 1 << 30});
  ASSERT_TRUE(id.ok());
  EXPECT_NEAR(id->step_times[0], 2 * pass + 4 * 1e-4 + 1e-9 * 16e6, 1e-3);
}

TEST(SimulatorTest, DilocoSynchronisesEveryInnerStepsAndOverlapHidesTheExchange) {
  OpGraph g = Chain(1);
  g.ops[0].param_bytes = 16e6;  // 8 MB of float32 pseudo-gradients
  const ClusterProfile p = Sites(2, 1e12, 8e6, 0);
  Plan plan = Pipeline(g, p, 4, {{0, 1}});
  plan.sync.diloco = true;
  plan.sync.inner_steps = 4;
  plan.sync.codec = *partitioner::PriceCodec("identity");
  const double pass = 3e9 / 1e12, step = 2 * pass + 2 * 16 / 8e6;
  plan.sync.overlap = false;
  auto blocking = Simulate(g, p, plan, {.steps = 8});
  ASSERT_TRUE(blocking.ok()) << blocking.status();
  // Steps 4 and 8 wait for the exchange (0.5 s + 0.5 s on the link, in 1 MiB chunks); the others do not.
  for (int s = 0; s < 8; ++s) {
    const bool sync = (s + 1) % 4 == 0;
    EXPECT_NEAR(blocking->step_times[s], step + (sync ? 1.0 : 0.0), 0.01) << "step " << s + 1;
  }
  // With overlap the exchange runs beside the next 4 steps (4 x 0.006 s: not long enough to hide 1 s of
  // link time), and step 8 waits for what is left. The workers of a one-stage plan wait for no norm:
  // only replica 0 awaits the other's loss, whose message of step 5 queues behind the exchange's first
  // chunk on the same link (1 MiB: 0.13 s), as in the executors; steps 6 and 7 then wait for nothing.
  plan.sync.overlap = true;
  auto overlapped = Simulate(g, p, plan, {.steps = 8});
  ASSERT_TRUE(overlapped.ok());
  EXPECT_NEAR(overlapped->step_times[3], step, 0.01);
  EXPECT_NEAR(overlapped->step_times[4], step + (1 << 20) / 8e6, 0.01);
  for (int s = 5; s < 7; ++s) EXPECT_NEAR(overlapped->step_times[s], step, 0.001) << "step " << s + 1;
  const double rest =
      overlapped->step_times[4] + overlapped->step_times[5] + overlapped->step_times[6] + overlapped->step_times[7];
  EXPECT_NEAR(rest, 1.0, 4 * step);
  for (const auto& l : overlapped->links) EXPECT_LE(l.busy_fraction, 1 + 1e-9) << l.from << " -> " << l.to;

  // Two fragments: half the bytes every 2 steps (0.25 s + 0.25 s on the link when not overlapped).
  plan.sync.overlap = false;
  plan.sync.fragments = 2;
  auto fragments = Simulate(g, p, plan, {.steps = 8});
  ASSERT_TRUE(fragments.ok());
  for (int s = 0; s < 8; ++s)
    EXPECT_NEAR(fragments->step_times[s], step + ((s + 1) % 2 == 0 ? 0.5 : 0.0), 0.01) << "step " << s + 1;

  // SparseLoCo (plan.json sync.sparse_sum): each replica sends its whole pseudo-gradient, top-k in the codec,
  // to the other, and nothing comes back (executor/replica_sync.h): 8 MB x ratio at 8 MB/s.
  plan.sync.fragments = 1;
  plan.sync.codec = *partitioner::PriceCodec("topk-int8:k=0.1");
  ASSERT_TRUE(plan.sync.UseSparseSum().ok());
  const double sparse_exchange = plan.sync.codec.ratio;
  auto sparse = Simulate(g, p, plan, {.steps = 8});
  ASSERT_TRUE(sparse.ok());
  for (int s = 0; s < 8; ++s)
    EXPECT_NEAR(sparse->step_times[s], step + ((s + 1) % 4 == 0 ? sparse_exchange : 0.0), 0.01) << "step " << s + 1;
}

// Two whole pipelines under DiLoCo (s0 -> s1 and s2 -> s3, the same shares at both stages) exchange their
// norms along their own stages only (executor: StageAssignment::whole_pipelines): between syncs no step waits
// on the links between the pipelines, however long they are. Stage 0's replica 0 hears the other
// pipeline's loss share one latency late, which delays only the first step.
TEST(SimulatorTest, WholeDilocoPipelinesWaitForNoLinkBetweenThemBetweenSyncs) {
  const OpGraph g = Chain(2);
  auto steps = [&](double between) {
    ClusterProfile p = Sites(4, 1e12, 1e9, 1e-3);
    for (auto& l : p.links) {
      const bool within = (l.from == "s0" && l.to == "s1") || (l.from == "s1" && l.to == "s0") ||
                          (l.from == "s2" && l.to == "s3") || (l.from == "s3" && l.to == "s2");
      if (!within) l.latency_seconds = between;
    }
    Plan plan = Pipeline(g, p, 4, {{0, 2}, {1, 3}});
    plan.sync.diloco = true;
    plan.sync.inner_steps = 100;  // no exchange within the simulated steps
    plan.sync.codec = *partitioner::PriceCodec("identity");
    auto r = Simulate(g, p, plan, {.steps = 6});
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->step_times : std::vector<double>{};
  };
  const std::vector<double> near = steps(1e-3), far = steps(0.5);
  ASSERT_EQ(near.size(), 6u);
  ASSERT_EQ(far.size(), 6u);
  for (int s = 1; s < 6; ++s) EXPECT_NEAR(far[s], near[s], 1e-6) << "step " << s + 1;
}

TEST(SimulatorTest, PlanJsonRoundTripsAndErrorsNameTheField) {
  const OpGraph g = Chain(6);
  const ClusterProfile p = Sites(3, 1e12, 1e8, 0.01);
  partitioner::PlanOptions o;
  o.micro_batches = 6;
  o.deep_pipeline = true;
  o.adaptive_compression = true;
  o.replication = true;
  o.zero = 1;
  auto plan = partitioner::PlanPipeline(g, p, o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  plan->stages[0].recompute = true;
  auto back = ParsePlanJson(partitioner::PlanJson(*plan, g), "plan.json", g, p);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->stages.size(), plan->stages.size());
  for (size_t k = 0; k < plan->stages.size(); ++k) {
    EXPECT_EQ(back->stages[k].sites, plan->stages[k].sites);
    EXPECT_EQ(back->stages[k].micro_batches, plan->stages[k].micro_batches);
    EXPECT_EQ(back->stages[k].in_flight, plan->stages[k].in_flight);
    EXPECT_EQ(back->stages[k].recompute, plan->stages[k].recompute);
  }
  EXPECT_EQ(back->zero, plan->zero);
  for (size_t k = 0; k < plan->links.size(); ++k) {
    EXPECT_EQ(back->links[k].codec, plan->links[k].codec);
    EXPECT_DOUBLE_EQ(back->links[k].bytes, plan->links[k].bytes);
  }
  auto sim = Simulate(g, p, *back);
  ASSERT_TRUE(sim.ok()) << sim.status();

  auto err = [&](const std::string& text) {
    return std::string(ParsePlanJson(text, "p.json", g, p).status().message());
  };
  EXPECT_THAT(err("[]"), testing::HasSubstr("p.json: top level"));
  EXPECT_THAT(err(R"({"micro_batches": 4, "stages": [{"sites": ["nowhere"], "last_op": 5}]})"),
              testing::HasSubstr("p.json: stages[0].sites: site 'nowhere' is not in the profile"));
  EXPECT_THAT(err(R"({"micro_batches": 4, "stages": [{"sites": ["s0"], "last_op": 3}]})"),
              testing::HasSubstr("p.json: stages: the last stage ends at op 3"));
  EXPECT_THAT(
      err(R"({"micro_batches": 4, "stages": [{"sites": ["s0", "s1"], "last_op": 5, "micro_batches": [1, 2]}]})"),
      testing::HasSubstr("stages[0].micro_batches: the counts sum to 3, not 4"));
  EXPECT_THAT(err(R"({"micro_batches": 4, "stages": [{"sites": ["s0"], "last_op": 2}, {"sites": ["s1"], "last_op": 5}],
                      "links": [{"codec": "zip"}]})"),
              testing::HasSubstr("links[0].codec: 'zip' is not a codec"));
  EXPECT_THAT(err(R"({"micro_batches": 4, "zero": 2, "stages": [{"sites": ["s0"], "last_op": 5}]})"),
              testing::HasSubstr("p.json: zero: expected 0 or 1"));
  EXPECT_THAT(err(R"({"micro_batches": 4, "stages": [{"sites": ["s0"], "last_op": 5, "recompute": 1}]})"),
              testing::HasSubstr("p.json: stages[0].recompute: expected true or false"));
  EXPECT_THAT(err(R"({"micro_batches": 4, "stages": [{"sites": ["s0"], "last_op": 5}], "sync": {"mode": "often"}})"),
              testing::HasSubstr("sync.mode"));
  EXPECT_THAT(err(R"({"micro_batches": 4, "stages": [{"sites": ["s0"], "last_op": 5}],
                      "sync": {"mode": "diloco", "codec": "int4", "sparse_sum": true}})"),
              testing::HasSubstr("sync.sparse_sum: a sparse sum needs a top-k codec, not 'int4'"));
}

TEST(SimulatorTest, IncreasingDepthsAreReportedAsStuckNotHung) {
  const OpGraph g = Chain(4);
  const ClusterProfile p = Sites(2, 1e12, 1e8, 0);
  Plan plan = Pipeline(g, p, 8, {{0}, {1}});
  plan.stages[0].in_flight = 1;
  plan.stages[1].in_flight = 4;
  auto r = Simulate(g, p, plan);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), testing::HasSubstr("never finished"));
}

TEST(SimulatorTest, TimelineShowsEverySiteAndActivity) {
  const OpGraph g = Chain(4);
  const ClusterProfile p = Sites(3, 1e12, 1e7, 0.02);
  auto r = Simulate(g, p, Pipeline(g, p, 4, {{0}, {1, 2}}, "int8"));
  ASSERT_TRUE(r.ok()) << r.status();
  const std::string svg = TimelineSvg(*r);
  for (const char* s : {"s0 (stage 1)", "s1 (stage 2)", "s2 (stage 2)", "<title>forward mb", "<title>backward mb",
                        "<title>send mb", "<title>control"})
    EXPECT_THAT(svg, testing::HasSubstr(s));
  for (const auto& a : r->timeline) {
    EXPECT_GE(a.start, 0) << a.kind;
    EXPECT_LE(a.end, r->last_step_seconds + 1e-9) << a.kind;
  }
  int forwards = 0;
  for (const auto& a : r->timeline) forwards += a.kind == "forward";
  EXPECT_EQ(forwards, 8);  // 4 micro-batches through 2 stages
  const std::string j = SimulationJson(*r);
  for (const char* key : {"\"step_seconds\"", "\"utilisation\"", "\"bubble_fraction\"", "\"links\"", "\"stages\""})
    EXPECT_THAT(j, testing::HasSubstr(key));
}

}  // namespace
}  // namespace meridian::simulator

namespace meridian::simulator {
namespace {

std::string Source(const std::string& path) { return std::string(MERIDIAN_TEST_SOURCE_DIR) + "/" + path; }

TEST(FleetTest, TheExampleFleetHasItsSitesLinksAndThreeSystems) {
  auto fleet = LoadFleet(Source("examples/fleets/llama7b-geo.yaml"));
  ASSERT_TRUE(fleet.ok()) << fleet.status();
  ASSERT_EQ(fleet->profile.sites.size(), 8u);
  EXPECT_EQ(fleet->profile.links.size(), 8u * 7u);
  // 8 H100s at 989.4 TFLOP/s and MFU 0.4; 8 x 80 GiB.
  EXPECT_DOUBLE_EQ(fleet->profile.sites[0].flops_per_second, 8 * 989.4e12 * 0.4);
  EXPECT_DOUBLE_EQ(fleet->profile.sites[0].memory_bytes, 8 * 85899345920.0);
  EXPECT_DOUBLE_EQ(fleet->profile.sites[0].uplink_bytes_per_second, 1e9 / 8);
  auto latency = [&](const std::string& a, const std::string& b) {
    for (const auto& l : fleet->profile.links)
      if (l.from.rfind(a, 0) == 0 && l.to.rfind(b, 0) == 0) return l.latency_seconds;
    return -1.0;
  };
  EXPECT_DOUBLE_EQ(latency("us-east", "us-east"), 0.001);    // intra-region, 2 ms RTT
  EXPECT_DOUBLE_EQ(latency("us-east", "us-west"), 0.025);    // intra-continent, 50 ms
  EXPECT_DOUBLE_EQ(latency("us-east", "eu-west"), 0.0375);   // transatlantic, 75 ms
  EXPECT_DOUBLE_EQ(latency("asia-east", "us-west"), 0.055);  // transpacific, 110 ms
  EXPECT_DOUBLE_EQ(latency("eu-west", "asia-east"), 0.075);  // Europe-Asia, 150 ms
  EXPECT_EQ(fleet->graph.ops.size(), 66u);                   // LLaMA-7B: embed, 32 x (attn, mlp), head
  const auto systems = ProjectFleet(*fleet);
  ASSERT_EQ(systems.size(), 3u);
  for (const auto& s : systems) {
    ASSERT_TRUE(s.feasible) << s.system << ": " << s.why;
    EXPECT_GT(s.tokens_per_second, 0);
    EXPECT_GT(s.utilisation, 0);
    EXPECT_LE(s.utilisation, 1 + 1e-9);
    EXPECT_GT(s.step_seconds, 0);
  }
  EXPECT_EQ(systems[0].system, "pipeline");
  EXPECT_EQ(systems[2].system, "ddp");
  EXPECT_THAT(systems[2].layout, testing::HasSubstr("1 stage (sites per stage: 8)"));
  // DiLoCo sends its pseudo-gradients once every 50 steps instead of every step: at 1 Gbit/s it is faster.
  EXPECT_GT(systems[1].tokens_per_second, systems[2].tokens_per_second);
}

TEST(FleetTest, AModelLargerThanASiteCannotRunAsDdp) {
  const std::string dir = ::testing::TempDir() + "/fleet70b";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/f.yaml") << "model: " << Source("examples/models/llama-70b/config.json") << "\n"
                                 << "gpus: " << Source("examples/profiles/gpus") << "\n"
                                 << "bandwidth_gbit: 10\nmicro_batches: 16\n"
                                 << "sites:\n  - {gpu: h100-sxm, count: 4, region: us-east}\n";
  auto fleet = LoadFleet(dir + "/f.yaml");
  ASSERT_TRUE(fleet.ok()) << fleet.status();
  const auto systems = ProjectFleet(*fleet, {.steps = 2});
  ASSERT_EQ(systems.size(), 3u);
  EXPECT_TRUE(systems[0].feasible) << systems[0].why;  // 70B x 16 bytes does not fit 640 GiB: a pipeline does
  EXPECT_FALSE(systems[2].feasible);
  EXPECT_FALSE(systems[2].why.empty());
}

TEST(FleetTest, ErrorsNameTheFileAndField) {
  const std::string dir = ::testing::TempDir() + "/fleetbad";
  std::filesystem::create_directories(dir);
  auto err = [&](const std::string& body) {
    std::ofstream(dir + "/f.yaml") << "model: " << Source("examples/models/llama-7b/config.json") << "\n"
                                   << "gpus: " << Source("examples/profiles/gpus") << "\n"
                                   << body;
    return std::string(LoadFleet(dir + "/f.yaml").status().message());
  };
  EXPECT_THAT(err("bandwidth_gbit: 1\nsites:\n  - {gpu: tpu-v9, region: us-east}\n"),
              testing::HasSubstr("f.yaml: sites[0].gpu: device 'tpu-v9'"));
  EXPECT_THAT(err("sites:\n  - {gpu: h100-sxm, region: us-east}\n"),
              testing::HasSubstr("f.yaml: bandwidth_gbit: missing"));
  EXPECT_THAT(err("bandwidth_gbit: 1\nsites:\n  - {gpu: h100-sxm, region: us-east}\n  - {gpu: l40s, region: mars-1}\n"),
              testing::HasSubstr("no preset for regions 'us-east' and 'mars-1'"));
  EXPECT_THAT(err("bandwidth_gbit: 1\nspeed: 3\nsites:\n  - {gpu: h100-sxm, region: us-east}\n"),
              testing::HasSubstr("f.yaml: speed: unknown field"));
  EXPECT_THAT(err("bandwidth_gbit: 1\nsites:\n  - {gpu: ../../etc/passwd, region: us-east}\n"),
              testing::HasSubstr("is not a device profile name"));
}

// Failures over a long run: closed-form cases, the Monte Carlo against the closed form, the best interval.
TEST(FailuresTest, NeverFailingSitesLoseOnlyTheCheckpoints) {
  FailureModel m;
  m.mtbf_seconds = {{"a", std::numeric_limits<double>::infinity()}};
  m.interval_steps = 90;
  m.checkpoint_seconds = 10;
  m.run_seconds = 100 * 100;  // exactly 100 segments of 90 x 1 s + 10 s
  auto r = SimulateFailures(1.0, m);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NEAR(r->goodput, 0.9, 1e-12);
  EXPECT_NEAR(r->goodput_p10, 0.9, 1e-12);
  EXPECT_DOUBLE_EQ(r->analytic_goodput, 0.9);
  EXPECT_EQ(r->expected_failures, 0);
}

TEST(FailuresTest, MonteCarloAgreesWithTheClosedFormAndTheRatesAdd) {
  FailureModel m;
  // Four sites of 4 h: one failure an hour for the run.
  m.mtbf_seconds = {{"a", 4 * 3600.0}, {"b", 4 * 3600.0}, {"c", 4 * 3600.0}, {"d", 4 * 3600.0}};
  m.interval_steps = 200;
  m.checkpoint_seconds = 20;
  m.detection_seconds = 5;
  m.restore_seconds = 40;
  m.run_seconds = 30 * 86400;
  m.trials = 100;
  const double T = 2.0;
  auto r = SimulateFailures(T, m);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_DOUBLE_EQ(r->system_mtbf_seconds, 3600);
  EXPECT_NEAR(r->expected_failures, 30 * 24, 1e-9);
  // Segments of 420 s against a 3600 s MTBF: (3600 + 45) (e^(420/3600) - 1) = 450.8 s for 400 s of work.
  EXPECT_NEAR(r->analytic_goodput, 400 / ((3600 + 45) * std::expm1(420.0 / 3600)), 1e-12);
  EXPECT_NEAR(r->analytic_goodput, 0.887, 0.001);
  EXPECT_NEAR(r->goodput, r->analytic_goodput, 0.005);  // 30 days x 100 runs: the mean is tight
  EXPECT_LT(r->goodput_p10, r->goodput);
  // A finer and a coarser interval than the best both do worse; the best is near Young's estimate when
  // checkpoints are cheap against the MTBF.
  EXPECT_GE(r->best_interval_goodput, AnalyticGoodput(T, 3600, r->best_interval_steps / 2, 20, 45));
  EXPECT_GE(r->best_interval_goodput, AnalyticGoodput(T, 3600, 2 * r->best_interval_steps, 20, 45));
  EXPECT_GE(r->best_interval_goodput, r->analytic_goodput);
  EXPECT_NEAR(r->young_interval_steps, std::sqrt(2 * 20 * 3600.0) / T, 1e-9);
  EXPECT_NEAR(r->best_interval_steps, r->young_interval_steps, 0.25 * r->young_interval_steps);
  // Halving every site's MTBF halves the system's and costs goodput.
  for (auto& [site, mtbf] : m.mtbf_seconds) mtbf /= 2;
  auto worse = SimulateFailures(T, m);
  ASSERT_TRUE(worse.ok());
  EXPECT_DOUBLE_EQ(worse->system_mtbf_seconds, 1800);
  EXPECT_LT(worse->goodput, r->goodput - 0.03);
}

TEST(FailuresTest, BadInputsNameTheField) {
  FailureModel m;
  EXPECT_THAT(std::string(SimulateFailures(1, m).status().message()), testing::HasSubstr("mtbf: no sites"));
  m.mtbf_seconds = {{"a", 0}};
  EXPECT_THAT(std::string(SimulateFailures(1, m).status().message()), testing::HasSubstr("site 'a'"));
  m.mtbf_seconds = {{"a", 100}};
  EXPECT_THAT(std::string(SimulateFailures(0, m).status().message()), testing::HasSubstr("step_seconds"));
  m.checkpoint_seconds = -1;
  EXPECT_THAT(std::string(SimulateFailures(1, m).status().message()), testing::HasSubstr("checkpoint_seconds"));
  m.checkpoint_seconds = 0;
  m.interval_steps = 0;
  EXPECT_THAT(std::string(SimulateFailures(1, m).status().message()), testing::HasSubstr("checkpoint interval"));
}

}  // namespace
}  // namespace meridian::simulator
