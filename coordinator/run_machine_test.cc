// The run's state machine driven by hand: events in, actions out, time passed explicitly. Each scenario
// of recovery runs in milliseconds (tests/coordinator_test.cc runs the same ones with real processes).
#include "coordinator/run_machine.h"
#include "partitioner/model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <regex>
#include <set>

#include "core/run_layout.h"

namespace meridian::coordinator {
namespace {

using ::testing::ContainsRegex;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kRun[] = "r";

// A LLaMA graph with `heads` attention and key-value heads, 2 sequences of `sequence` tokens per micro-batch.
partitioner::OpGraph Graph(int vocab, int hidden, int intermediate, int layers, int heads, int sequence) {
  partitioner::LlamaShape shape;
  shape.vocab_size = vocab;
  shape.hidden_size = hidden;
  shape.intermediate_size = intermediate;
  shape.num_hidden_layers = layers;
  shape.num_attention_heads = heads;
  shape.num_key_value_heads = heads;
  partitioner::LlamaGraphOptions go;
  go.micro_batch_size = 2;
  go.sequence_length = sequence;
  return partitioner::BuildLlamaGraph(shape, go);
}

partitioner::OpGraph SmallGraph() { return Graph(256, 64, 128, 2, 4, 16); }  // 6 ops

// A model large enough per op that the planner pipelines it over the three sites of Config().
partitioner::OpGraph LargeGraph() { return Graph(32000, 1024, 4096, 8, 16, 128); }

// A three-site cluster (a, b, c), a 20-step job with checkpoints every 5 steps.
RunConfig Config(core::OnFailure on_failure = core::OnFailure::kReplan) {
  RunConfig c;
  c.spec.name = "t";
  c.spec.sites = {{"a", {"127.0.0.1", 7001}}, {"b", {"127.0.0.1", 7002}}, {"c", {"127.0.0.1", 7003}}};
  c.spec.heartbeat_timeout_seconds = 5;
  c.spec.on_failure = on_failure;
  c.job.steps = 20;
  c.job.global_batch = 8;
  c.job.micro_batches = 4;
  c.job.checkpoint.interval = 5;
  c.job_yaml = "job: {}";
  c.job_dir = "/jobs";
  c.steps = 20;
  c.micro_batches = 4;
  c.even_split = true;  // one stage per site, in spec order: the layouts below are known
  c.run_id = kRun;
  c.run_dir = "/runs/t";
  c.graph = SmallGraph();
  return c;
}

// The straggler tests' run: the planner's layout (a pinned one is never re-planned) of LargeGraph over
// `steps` steps, with heartbeats of 0.1 s.
RunConfig StragglerConfig(int steps = 100) {
  RunConfig c = Config();
  c.even_split = false;
  c.spec.heartbeat_interval_seconds = 0.1;
  c.steps = c.job.steps = steps;
  c.graph = LargeGraph();
  return c;
}

// What site `site` reports after the first round of measuring: its device and the graph (no link yet).
v1::ProfileReport Profile(const std::string& site, const std::string& error = "", double memory = 8e9) {
  v1::ProfileReport r;
  r.set_site(site);
  if (!error.empty()) {
    r.set_error(error);
    return r;
  }
  partitioner::ClusterProfile one;
  one.sites.push_back({site, 1e11, memory, {}, {}});
  r.set_site_profile_json(nlohmann::json::parse(partitioner::ProfileToJson(one))["sites"][0].dump());
  r.set_graph_json(partitioner::GraphToJson(SmallGraph()));
  r.set_links_json("[]");
  return r;
}

// What site `site` reports after the second round, asked to probe `peers`: its links to them, both ways.
v1::ProfileReport Links(const std::string& site, const std::vector<std::string>& peers, double bandwidth = 1e8,
                        double latency = 1e-3) {
  v1::ProfileReport r;
  r.set_site(site);
  nlohmann::json links = nlohmann::json::array();
  for (const auto& other : peers) {
    links.push_back(
        {{"from", site}, {"to", other}, {"bandwidth_bytes_per_second", bandwidth}, {"latency_seconds", latency}});
    links.push_back(
        {{"from", other}, {"to", site}, {"bandwidth_bytes_per_second", bandwidth}, {"latency_seconds", latency}});
  }
  r.set_links_json(links.dump());
  return r;
}

v1::StageDone Done(const std::string& site, const std::string& job_id, const std::string& error = "") {
  v1::StageDone d;
  d.set_site(site);
  d.set_job_id(job_id);
  d.set_steps(error.empty() ? 20 : 7);
  d.set_error(error);
  return d;
}

v1::MetricsReport Metrics(const std::string& site, const std::string& job_id, int stage, int step) {
  v1::MetricsReport m;
  m.set_site(site);
  m.set_job_id(job_id);
  m.set_stage(stage);
  m.set_step(step);
  m.set_loss(2.5);
  m.set_step_seconds(0.1);
  m.set_tokens(128);
  m.set_compute_seconds(0.05);
  return m;
}

// Feeds events at a clock it advances by hand, and keeps what the machine answered. Unless
// `answer_link_probes` is false it also plays the sites' part in the second round of measuring: each
// links-only profile request the machine sends is answered at once with Links(site, its peers,
// link_bandwidth, link_latency), and what the machine answers to that is returned with the rest.
class Driver {
 public:
  explicit Driver(RunConfig config) : machine_(std::move(config)) {}

  std::vector<Action> Feed(decltype(Event::what) what, double advance_seconds = 0.01) {
    now_ += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(advance_seconds));
    std::vector<Action> out = machine_.Handle({now_, std::move(what)});
    if (answer_link_probes) {
      std::vector<v1::ProfileReport> answers;
      for (const auto& a : out)
        if (const auto* c = std::get_if<SendCommand>(&a); c && c->command.profile().links_only()) {
          std::vector<std::string> peers;
          for (const auto& p : c->command.profile().peers()) peers.push_back(p.site());
          answers.push_back(Links(c->site, peers, link_bandwidth, link_latency));
        }
      for (auto& r : answers) {
        auto more = Feed(ProfileReported{std::move(r)});
        out.insert(out.end(), more.begin(), more.end());
      }
    }
    last_ = out;
    return last_;
  }
  bool answer_link_probes = true;
  double link_bandwidth = 1e8, link_latency = 1e-3;
  // Starts the run and lets `sites` register, then report their profiles.
  void JoinAndProfile(const std::vector<std::string>& sites) {
    Feed(RunStarted{});
    for (const auto& s : sites) Feed(SiteRegistered{s, "127.0.0.1:9" + s, "cpu"});
    for (const auto& s : sites) Feed(ProfileReported{Profile(s)});
  }

  RunMachine& machine() { return machine_; }
  const std::vector<Action>& last() const { return last_; }

 private:
  RunMachine machine_;
  Clock::time_point now_{};
  std::vector<Action> last_;
};

template <typename T>
std::vector<T> All(const std::vector<Action>& actions) {
  std::vector<T> out;
  for (const auto& a : actions)
    if (const T* t = std::get_if<T>(&a)) out.push_back(*t);
  return out;
}

// The commands that ask a site to measure (leaving out the settle commands that end the first round).
std::vector<SendCommand> Profiles(const std::vector<Action>& actions) {
  std::vector<SendCommand> out;
  for (const auto& c : All<SendCommand>(actions))
    if (c.command.has_profile()) out.push_back(c);
  return out;
}

std::string Printed(const std::vector<Action>& actions) {
  std::string out;
  for (const auto& p : All<Print>(actions)) out += p.text;
  return out;
}

std::optional<int> ExitCode(const std::vector<Action>& actions) {
  auto exits = All<Exit>(actions);
  if (exits.empty()) return std::nullopt;
  return exits.back().code;
}

// The assignments among `actions`, by site.
std::map<std::string, v1::StageAssignment> Assignments(const std::vector<Action>& actions) {
  std::map<std::string, v1::StageAssignment> out;
  for (const auto& c : All<SendCommand>(actions))
    if (c.command.has_assign()) out[c.site] = c.command.assign();
  return out;
}

std::vector<std::string> Sites(const std::map<std::string, v1::StageAssignment>& assignments) {
  std::vector<std::string> out;
  for (const auto& [site, a] : assignments) out.push_back(site);
  return out;
}

TEST(RunMachine, JoinsProfilesPlansAndFinishes) {
  RunConfig config = Config();
  config.profile_repeats = 3;
  config.probe_seconds = 0.25;  // --profile-repeats and --probe-seconds reach the sites
  Driver d(config);
  d.answer_link_probes = false;  // both rounds of measuring by hand
  auto started = d.Feed(RunStarted{});
  EXPECT_TRUE(started.empty());
  d.Feed(SiteRegistered{"a", "127.0.0.1:9a", "cpu"});
  d.Feed(SiteRegistered{"b", "127.0.0.1:9b", "cpu"});
  auto joined = d.Feed(SiteRegistered{"c", "127.0.0.1:9c", "cpu"});
  EXPECT_THAT(Printed(joined), HasSubstr("3 sites joined"));
  auto profile_commands = All<SendCommand>(joined);
  ASSERT_EQ(profile_commands.size(), 3u);
  for (const auto& c : profile_commands) {  // first every site's device and the model, no link
    ASSERT_TRUE(c.command.has_profile());
    EXPECT_EQ(c.command.profile().peers_size(), 0);
    EXPECT_FALSE(c.command.profile().links_only());
    EXPECT_EQ(c.command.profile().repeats(), 3);
    // Each keeps computing after it has measured, until its next command: no site's last rounds run on a
    // host the others have left quiet.
    EXPECT_GT(c.command.profile().keep_busy_seconds(), 0);
  }
  EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kProfiling);

  EXPECT_TRUE(All<SendCommand>(d.Feed(ProfileReported{Profile("a")})).empty());
  EXPECT_TRUE(All<SendCommand>(d.Feed(ProfileReported{Profile("b")})).empty());  // c still measures its model
  // Then the links, each pair once (the site whose name sorts first probes both directions), in rounds in
  // which no site probes or is probed twice at once: b-c, then a-c, then a-b.
  // First every site is told the round is over (those kept computing stop), then the first probe goes.
  const auto round_over_actions = d.Feed(ProfileReported{Profile("c")});
  const auto round_over = All<SendCommand>(round_over_actions);
  ASSERT_EQ(round_over.size(), 4u);
  std::set<std::string> settled;
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(round_over[i].command.settle()) << i;
    settled.insert(round_over[i].site);
  }
  EXPECT_EQ(settled, (std::set<std::string>{"a", "b", "c"}));
  auto probes = Profiles(round_over_actions);
  ASSERT_EQ(probes.size(), 1u);
  EXPECT_EQ(probes[0].site, "b");
  EXPECT_TRUE(probes[0].command.profile().links_only());
  EXPECT_EQ(probes[0].command.profile().keep_busy_seconds(), 0);
  ASSERT_EQ(probes[0].command.profile().peers_size(), 1);
  EXPECT_EQ(probes[0].command.profile().peers(0).site(), "c");
  EXPECT_EQ(probes[0].command.profile().peers(0).address(), "127.0.0.1:9c");
  EXPECT_EQ(probes[0].command.profile().probe_seconds(), 0.25);
  probes = All<SendCommand>(d.Feed(ProfileReported{Links("b", {"c"})}));
  ASSERT_EQ(probes.size(), 1u);
  EXPECT_EQ(probes[0].site, "a");
  ASSERT_EQ(probes[0].command.profile().peers_size(), 1);
  EXPECT_EQ(probes[0].command.profile().peers(0).site(), "c");
  probes = All<SendCommand>(d.Feed(ProfileReported{Links("a", {"c"})}));
  ASSERT_EQ(probes.size(), 1u);
  EXPECT_EQ(probes[0].site, "a");
  ASSERT_EQ(probes[0].command.profile().peers_size(), 1);
  EXPECT_EQ(probes[0].command.profile().peers(0).site(), "b");
  auto planned = d.Feed(ProfileReported{Links("a", {"b"})});
  EXPECT_THAT(Printed(planned), HasSubstr("predicted step time"));
  EXPECT_THAT(Printed(planned), HasSubstr("training: 3 stages, 20 steps\n"));
  auto files = All<WriteRunFile>(planned);
  ASSERT_EQ(files.size(), 3u);
  EXPECT_EQ(files[0].name, core::kProfileFile);
  EXPECT_EQ(files[2].name, core::kPlanFile);
  auto begun = All<BeginAttempt>(planned);
  ASSERT_EQ(begun.size(), 1u);
  EXPECT_EQ(begun[0].job_id, kRun);
  EXPECT_EQ(begun[0].file_writers, (std::map<std::string, int>{{"a", 0}, {"b", 1}, {"c", 2}}));
  auto assigned = Assignments(planned);
  ASSERT_THAT(Sites(assigned), ElementsAre("a", "b", "c"));
  EXPECT_EQ(assigned["a"].next_site(), "b");
  EXPECT_EQ(assigned["b"].prev_address(), "127.0.0.1:9a");
  EXPECT_EQ(assigned["c"].last_op(), 5);
  EXPECT_EQ(assigned["a"].resume_step(), 0);
  EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kTraining);

  // Stage 0's reports are the progress; the others' feed the breakdown.
  d.Feed(MetricsReported{Metrics("c", kRun, 2, 0)});
  auto step = d.Feed(MetricsReported{Metrics("a", kRun, 0, 0)});
  EXPECT_THAT(Printed(step), HasSubstr("step 1/20  loss 2.5000"));
  EXPECT_THAT(Printed(step), HasSubstr("slowest"));
  auto jsonl = All<WriteRunFile>(step);
  ASSERT_EQ(jsonl.size(), 1u);
  EXPECT_EQ(jsonl[0].name, core::kMetricsFile);
  EXPECT_TRUE(jsonl[0].append);
  EXPECT_EQ(nlohmann::json::parse(jsonl[0].content)["stages"].size(), 2u);

  d.Feed(StageReportedDone{Done("a", kRun)});
  d.Feed(StageReportedDone{Done("b", kRun)});
  auto end = d.Feed(StageReportedDone{Done("c", kRun)});
  EXPECT_THAT(Printed(end), HasSubstr("done: 20 steps"));
  EXPECT_EQ(All<StopAll>(end).size(), 1u);
  EXPECT_EQ(ExitCode(end), 0);
  EXPECT_TRUE(d.Feed(Tick{}).empty());  // over
}

// plan.json says what the executors run: a job's fixed codecs (or none) are the plan's, not identity.
TEST(RunMachine, APlanOfAFixedCodecRecordsTheCodecItsExecutorsUse) {
  for (auto policy : {core::CompressionPolicy::kFixed, core::CompressionPolicy::kNone}) {
    RunConfig c = Config();
    c.job.compression.policy = policy;
    c.job.compression.activations = "int8";
    Driver d(std::move(c));
    d.JoinAndProfile({"a", "b", "c"});
    const std::string want = policy == core::CompressionPolicy::kFixed ? "int8" : "identity";
    std::string plan_json;
    for (const auto& f : All<WriteRunFile>(d.last()))
      if (f.name == core::kPlanFile) plan_json = f.content;
    ASSERT_FALSE(plan_json.empty());
    const auto links = nlohmann::json::parse(plan_json)["links"];
    ASSERT_EQ(links.size(), 2u);
    auto assigned = Assignments(d.last());
    for (const auto& l : links) EXPECT_EQ(l["codec"], want);
    EXPECT_EQ(assigned["a"].forward_codec(), want);
    EXPECT_EQ(assigned["b"].prev_forward_codec(), want);
  }
}

TEST(RunMachine, JoinTimeoutNamesTheMissingSites) {
  RunConfig c = Config();
  c.join_timeout_seconds = 10;
  Driver d(c);
  d.Feed(RunStarted{});
  d.Feed(SiteRegistered{"a", "127.0.0.1:9a", "cpu"});
  EXPECT_FALSE(ExitCode(d.Feed(Tick{}, 9)));
  auto out = d.Feed(Tick{}, 2);
  EXPECT_EQ(ExitCode(out), 1);
  EXPECT_THAT(Printed(out), HasSubstr("meridian run: sites did not join in time: b c"));
}

TEST(RunMachine, LostSiteWithReplanResumesOverTheSitesLeft) {
  Driver d(Config(core::OnFailure::kReplan));
  d.JoinAndProfile({"a", "b", "c"});
  ASSERT_EQ(d.machine().phase(), RunMachine::Phase::kTraining);
  d.Feed(MetricsReported{Metrics("a", kRun, 0, 6)});

  auto lost = d.Feed(HeartbeatLost{"b"});
  EXPECT_THAT(Printed(lost), HasSubstr("lost: site 'b' stopped answering (no heartbeat for 5 s)"));
  EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kDraining);
  EXPECT_TRUE(Assignments(lost).empty());

  // The survivors abandon the attempt (their neighbour's stream broke).
  EXPECT_TRUE(Assignments(d.Feed(StageReportedDone{Done("a", kRun, "stream to peer 'b' broke")})).empty());
  auto replanned = d.Feed(StageReportedDone{Done("c", kRun, "stream from peer 'b' broke")});
  EXPECT_THAT(Printed(replanned), HasSubstr("recovery: re-planning over the 2 sites left"));
  EXPECT_THAT(Printed(replanned), HasSubstr("resuming from the newest intact checkpoint"));
  auto assigned = Assignments(replanned);
  EXPECT_THAT(Sites(assigned), ElementsAre("a", "c"));
  EXPECT_EQ(assigned["a"].job_id(), "r-1");
  EXPECT_EQ(assigned["a"].resume_step(), -1);   // shared store: each stage loads the newest intact step
  EXPECT_EQ(assigned["a"].resume_run(), kRun);  // of this run's: not another run's left in the directory
  EXPECT_EQ(assigned["a"].next_site(), "c");
  EXPECT_EQ(d.machine().job_id(), "r-1");

  d.Feed(StageReportedDone{Done("a", "r-1")});
  EXPECT_EQ(ExitCode(d.Feed(StageReportedDone{Done("c", "r-1")})), 0);
}

// The event log (RUN/events.jsonl, the dashboard's events): joins, the plan, a lost site, the re-plan
// with its reason, the resume point and the end, each naming its site where it has one.
TEST(RunMachine, EventsRecordJoinsPlansLossesReplansAndTheEnd) {
  Driver d(Config(core::OnFailure::kReplan));
  std::vector<RecordEvent> events;
  auto keep = [&](const std::vector<Action>& out) {
    for (auto& e : All<RecordEvent>(out)) events.push_back(e);
  };
  keep(d.Feed(RunStarted{}));
  for (const char* s : {"a", "b", "c"}) keep(d.Feed(SiteRegistered{s, std::string("127.0.0.1:9") + s, "cpu"}));
  for (const char* s : {"a", "b", "c"}) keep(d.Feed(ProfileReported{Profile(s)}));
  keep(d.Feed(MetricsReported{Metrics("a", kRun, 0, 6)}));
  keep(d.Feed(HeartbeatLost{"b"}));
  keep(d.Feed(StageReportedDone{Done("a", kRun, "stream to peer 'b' broke")}));
  keep(d.Feed(StageReportedDone{Done("c", kRun, "stream from peer 'b' broke")}));
  d.Feed(StageReportedDone{Done("a", "r-1")});
  keep(d.Feed(StageReportedDone{Done("c", "r-1")}));
  std::vector<std::string> kinds;
  for (const auto& e : events) kinds.push_back(e.kind);
  EXPECT_THAT(kinds, ElementsAre("join", "join", "join", "profiled", "plan", "lost", "replan", "resume", "done"));
  EXPECT_EQ(events[0].site, "a");
  EXPECT_THAT(events[4].text, HasSubstr("planned: 3 stage(s) a -> b -> c"));
  EXPECT_EQ(events[5].site, "b");
  EXPECT_THAT(events[5].text, HasSubstr("re-planning without it"));
  EXPECT_THAT(events[6].text, HasSubstr("re-planned: 2 stage(s) a -> c"));
  EXPECT_THAT(events[6].text, HasSubstr("after site 'b' stopped answering"));
  EXPECT_THAT(events[6].text, HasSubstr("(without 'b')"));
  EXPECT_THAT(events[7].text, HasSubstr("resumes from the newest intact checkpoint"));
  EXPECT_THAT(events[8].text, HasSubstr("20 steps in"));
}

v1::StageDone DoneAt(const std::string& site, const std::string& job_id, int64_t steps) {
  v1::StageDone d = Done(site, job_id);
  d.set_steps(steps);
  return d;
}

// A site that asks to leave while it trains (`meridian drain`, or SIGTERM) is switched away from at a
// step boundary, the step lease granted (a few heartbeats ahead): every stage ends there with its checkpoint, the next
// plan leaves the site out and resumes from exactly that step, and the site is told to stop.
TEST(RunMachine, ALeavingSiteIsSwitchedAwayFromAtAStepBoundaryWithNothingLost) {
  RunConfig c = Config();
  c.spec.heartbeat_interval_seconds = 0.1;  // 3 heartbeats ahead: 3 steps of 0.1 s
  Driver d(c);
  d.JoinAndProfile({"a", "b", "c"});
  d.Feed(MetricsReported{Metrics("b", kRun, 1, 6)});
  d.Feed(MetricsReported{Metrics("a", kRun, 0, 6)});  // 7 steps done
  auto out = d.Feed(SiteLeaving{"b", "meridian drain"});
  auto boundary = All<SetBoundary>(out);
  ASSERT_EQ(boundary.size(), 1u);
  EXPECT_EQ(boundary[0].job_id, kRun);
  EXPECT_EQ(boundary[0].step, 10);
  EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kSwitching);
  EXPECT_THAT(Printed(out), HasSubstr("switch: site 'b' leaves (meridian drain); every stage ends after step 10"));
  EXPECT_TRUE(Assignments(out).empty());
  d.Feed(MetricsReported{Metrics("a", kRun, 0, 7)});  // the stages go on meanwhile
  // Each stage counts its bytes per attempt: 1 MB sent of 4 MB uncompressed before the switch.
  auto with_bytes = [](v1::StageDone done, int64_t wire, int64_t raw) {
    done.set_wire_bytes(wire);
    done.set_raw_bytes(raw);
    return done;
  };
  d.Feed(StageReportedDone{with_bytes(DoneAt("a", kRun, 10), 1000000, 4000000)});
  d.Feed(StageReportedDone{with_bytes(DoneAt("c", kRun, 10), 1000000, 4000000)});
  auto switched = d.Feed(StageReportedDone{with_bytes(DoneAt("b", kRun, 10), 1000000, 4000000)});
  EXPECT_THAT(Printed(switched), HasSubstr("switch: every stage saved step 10; re-planning"));
  auto cleared = All<SetBoundary>(switched);
  ASSERT_EQ(cleared.size(), 1u);
  EXPECT_EQ(cleared[0].step, 0);
  auto assigned = Assignments(switched);
  EXPECT_THAT(Sites(assigned), ElementsAre("a", "c"));
  EXPECT_EQ(assigned["a"].resume_step(), 10);  // exactly the boundary: nothing lost, nothing repeated
  EXPECT_EQ(assigned["c"].resume_step(), 10);
  EXPECT_EQ(assigned["a"].job_id(), "r-1");
  bool stopped_b = false;
  for (const auto& cmd : All<SendCommand>(switched)) stopped_b |= cmd.site == "b" && cmd.command.stop();
  EXPECT_TRUE(stopped_b);
  std::vector<std::string> kinds;
  for (const auto& e : All<RecordEvent>(switched)) kinds.push_back(e.kind);
  EXPECT_THAT(kinds, ElementsAre("replan", "resume"));
  EXPECT_THAT(All<RecordEvent>(switched)[0].text, HasSubstr("after site 'b' leaves (meridian drain)"));
  d.Feed(StageReportedDone{with_bytes(Done("a", "r-1"), 2000000, 8000000)});
  auto done = d.Feed(StageReportedDone{with_bytes(Done("c", "r-1"), 2000000, 8000000)});
  EXPECT_EQ(ExitCode(done), 0);
  // The run's bytes are both attempts': 3 + 4 MB of 12 + 16 MB uncompressed.
  EXPECT_THAT(Printed(done), HasSubstr("7.0 MB on the links, 25% of uncompressed"));
}

// Stages that do not all end at the boundary (one had passed it) are not trusted to line up: the next
// attempt resumes from the newest intact checkpoint, as after a loss. A spare that leaves is stopped at
// once and no switch happens.
TEST(RunMachine, AMisalignedSwitchResumesFromTheNewestCheckpointAndALeavingSpareJustStops) {
  RunConfig c = Config();
  c.spec.heartbeat_interval_seconds = 0.1;
  Driver d(c);
  d.JoinAndProfile({"a", "b", "c"});
  d.Feed(MetricsReported{Metrics("a", kRun, 0, 6)});
  d.Feed(SiteLeaving{"c", "its executor got SIGTERM"});
  d.Feed(StageReportedDone{DoneAt("a", kRun, 10)});
  d.Feed(StageReportedDone{DoneAt("b", kRun, 10)});
  auto out = d.Feed(StageReportedDone{DoneAt("c", kRun, 12)});
  EXPECT_THAT(Printed(out), HasSubstr("did not all end at step 10; resuming from the newest intact checkpoint"));
  auto assigned = Assignments(out);
  EXPECT_THAT(Sites(assigned), ElementsAre("a", "b"));
  EXPECT_EQ(assigned["a"].resume_step(), -1);

  Driver spare(Config());
  spare.Feed(RunStarted{});
  for (const char* s : {"a", "b", "c"}) spare.Feed(SiteRegistered{s, std::string("127.0.0.1:9") + s, "cpu"});
  // Leaving while measured: it is measured with the others, left out of the plan and stopped at its start.
  spare.Feed(SiteLeaving{"c", "meridian drain"});
  for (const char* s : {"a", "b"}) spare.Feed(ProfileReported{Profile(s)});
  auto planned = spare.Feed(ProfileReported{Profile("c")});
  EXPECT_THAT(Sites(Assignments(planned)), ElementsAre("a", "b"));
  EXPECT_TRUE(All<SetBoundary>(planned).empty());
  bool stopped_c = false;
  for (const auto& cmd : All<SendCommand>(planned)) stopped_c |= cmd.site == "c" && cmd.command.stop();
  EXPECT_TRUE(stopped_c);
}

// The stages run on a step lease: none is granted before an attempt's first report (SetLease with 0 steps
// comes with the assignments), then each report grants up to three heartbeats' worth of steps past the
// furthest stage, never less than before and never past the run's end; the switch's boundary is the
// largest lease granted, so no stage can have passed it. A switch then grants nothing more, and the next
// attempt starts again from no lease.
TEST(RunMachine, StagesRunOnALeaseAndASwitchIsPlacedAtTheLargestGranted) {
  RunConfig c = Config();
  c.spec.heartbeat_interval_seconds = 0.1;  // 3 heartbeats: 3 steps of 0.1 s
  Driver d(c);
  d.Feed(RunStarted{});
  for (const char* s : {"a", "b", "c"}) d.Feed(SiteRegistered{s, std::string("127.0.0.1:9") + s, "cpu"});
  d.Feed(ProfileReported{Profile("a")});
  d.Feed(ProfileReported{Profile("b")});
  auto started = d.Feed(ProfileReported{Profile("c")});
  auto first = All<SetLease>(started);
  ASSERT_EQ(first.size(), 1u) << Printed(started);
  EXPECT_EQ(first[0].job_id, kRun);
  EXPECT_EQ(first[0].steps, 0);
  EXPECT_FALSE(first[0].abandoned);
  // Before the assignments: no stage of the attempt may see an older attempt's lease as its own.
  size_t lease_at = 0, assign_at = 0;
  for (size_t i = 0; i < started.size(); ++i) {
    if (std::holds_alternative<SetLease>(started[i])) lease_at = i;
    if (const auto* cmd = std::get_if<SendCommand>(&started[i]); cmd && cmd->command.has_assign() && !assign_at)
      assign_at = i;
  }
  EXPECT_LT(lease_at, assign_at);

  auto granted = All<SetLease>(d.Feed(MetricsReported{Metrics("a", kRun, 0, 0)}));
  ASSERT_EQ(granted.size(), 1u);
  EXPECT_EQ(granted[0].steps, 1 + 3);
  EXPECT_EQ(All<SetLease>(d.Feed(MetricsReported{Metrics("b", kRun, 1, 0)})).size(), 0u) << "no more than before";
  EXPECT_EQ(All<SetLease>(d.Feed(MetricsReported{Metrics("a", kRun, 0, 1)}))[0].steps, 2 + 3);
  v1::MetricsReport slow = Metrics("a", kRun, 0, 2);
  slow.set_step_seconds(1.0);  // the fastest recent step still sets the margin: 3 steps
  EXPECT_EQ(All<SetLease>(d.Feed(MetricsReported{slow}))[0].steps, 3 + 3);
  for (int step = 3; step < 8; ++step) d.Feed(MetricsReported{Metrics("a", kRun, 0, step)});  // lease 11
  d.Feed(MetricsReported{Metrics("c", kRun, 2, 5)});
  auto out = d.Feed(SiteLeaving{"b", "meridian drain"});
  auto boundary = All<SetBoundary>(out);
  ASSERT_EQ(boundary.size(), 1u);
  EXPECT_EQ(boundary[0].step, 11);
  EXPECT_TRUE(All<SetLease>(d.Feed(MetricsReported{Metrics("a", kRun, 0, 8)})).empty()) << "switching grants nothing";
  for (const char* s : {"a", "b", "c"}) d.Feed(StageReportedDone{DoneAt(s, kRun, 11)});
  auto switched = d.last();
  EXPECT_THAT(Printed(switched), HasSubstr("every stage saved step 11"));
  auto next = All<SetLease>(switched);
  ASSERT_EQ(next.size(), 1u);
  EXPECT_EQ(next[0].job_id, "r-1");
  EXPECT_EQ(next[0].steps, 0);
  // Near the run's end the lease stops at its last step.
  int64_t largest = 0;
  for (int step = 11; step < 19; ++step)
    for (const auto& l : All<SetLease>(d.Feed(MetricsReported{Metrics("a", "r-1", 0, step)})))
      largest = std::max(largest, l.steps);
  EXPECT_EQ(largest, 20);
}

// A switch asked for before the attempt's first report (no lease granted: the resume step may be
// unknown) is placed at the step the first report names, since no stage goes past its first step of the
// attempt without a lease; every stage ends there and the next attempt resumes from exactly it.
TEST(RunMachine, ASwitchBeforeTheFirstReportIsPlacedAtTheAttemptsFirstStep) {
  Driver d(Config());
  d.JoinAndProfile({"a", "b", "c"});
  auto out = d.Feed(SiteLeaving{"c", "its executor got SIGTERM"});
  EXPECT_TRUE(All<SetBoundary>(out).empty()) << Printed(out);
  EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kSwitching);
  EXPECT_THAT(Printed(out), HasSubstr("every stage ends after its first step of this attempt"));
  auto placed = d.Feed(MetricsReported{Metrics("b", kRun, 1, 0)});
  auto boundary = All<SetBoundary>(placed);
  ASSERT_EQ(boundary.size(), 1u) << Printed(placed);
  EXPECT_EQ(boundary[0].job_id, kRun);
  EXPECT_EQ(boundary[0].step, 1);
  EXPECT_TRUE(All<SetLease>(placed).empty());
  EXPECT_TRUE(All<SetBoundary>(d.Feed(MetricsReported{Metrics("a", kRun, 0, 0)})).empty()) << "placed once";
  for (const char* s : {"a", "b"}) d.Feed(StageReportedDone{DoneAt(s, kRun, 1)});
  auto switched = d.Feed(StageReportedDone{DoneAt("c", kRun, 1)});
  EXPECT_THAT(Printed(switched), HasSubstr("switch: every stage saved step 1; re-planning"));
  auto assigned = Assignments(switched);
  EXPECT_THAT(Sites(assigned), ElementsAre("a", "b"));
  EXPECT_EQ(assigned["a"].resume_step(), 1);
}

// An attempt the coordinator abandons (a site lost) says so through the lease: a stage waiting for one
// ends at once instead of waiting out the drain time.
TEST(RunMachine, AnAbandonedAttemptsLeaseSaysSo) {
  Driver d(Config());
  d.JoinAndProfile({"a", "b", "c"});
  d.Feed(MetricsReported{Metrics("a", kRun, 0, 3)});
  auto lost = d.Feed(HeartbeatLost{"b"});
  ASSERT_EQ(d.machine().phase(), RunMachine::Phase::kDraining);
  auto lease = All<SetLease>(lost);
  ASSERT_EQ(lease.size(), 1u) << Printed(lost);
  EXPECT_EQ(lease[0].job_id, kRun);
  EXPECT_TRUE(lease[0].abandoned);
}

// A stage that fails while a switch waits for the attempt's first report is a failure like any other,
// not a missed boundary (none is placed yet); a report sent again (a stage waiting for its lease resends
// its latest) is neither logged nor counted.
TEST(RunMachine, AFailureBeforeTheBoundaryIsPlacedIsAFailureAndAResentReportIsIgnored) {
  Driver d(Config());
  d.JoinAndProfile({"a", "b", "c"});
  d.Feed(MetricsReported{Metrics("b", kRun, 1, 0)});
  EXPECT_TRUE(All<LogSite>(d.Feed(MetricsReported{Metrics("b", kRun, 1, 0)})).empty()) << Printed(d.last());
  Driver f(Config());
  f.JoinAndProfile({"a", "b", "c"});
  f.Feed(SiteLeaving{"c", "meridian drain"});
  ASSERT_EQ(f.machine().phase(), RunMachine::Phase::kSwitching);
  v1::StageDone failed = Done("a", kRun, "out of memory");
  failed.set_steps(0);
  auto out = f.Feed(StageReportedDone{failed});
  EXPECT_THAT(Printed(out), HasSubstr("stage 0 at site 'a' failed: out of memory"));
  EXPECT_EQ(f.machine().phase(), RunMachine::Phase::kFailing);
}

// The boundary (the lease granted) is three heartbeats' worth of steps ahead at the attempt's fastest
// recent pace: one slow step just before (0.41 s against 0.1 s) does not shrink it (a clean-clone run saw
// a stage pass a boundary set 8 steps ahead after such a step, before leases). A stage that still passes
// it (a site that breaks its lease), and a neighbour left waiting for it, fail: an unaligned end, not the
// run's failure -- the next attempt resumes from the newest intact checkpoint.
TEST(RunMachine, ABoundaryIsSetAtTheFastestRecentPaceAndAStageThatMissesItIsAnUnalignedEnd) {
  RunConfig c = Config();
  c.spec.heartbeat_interval_seconds = 1;
  c.steps = c.job.steps = 200;
  Driver d(c);
  d.JoinAndProfile({"a", "b", "c"});
  for (int step = 0; step < 10; ++step) {
    v1::MetricsReport m = Metrics("a", kRun, 0, step);
    m.set_step_seconds(step == 9 ? 0.41 : 0.1);
    d.Feed(MetricsReported{m});
  }
  auto out = d.Feed(SiteLeaving{"c", "meridian drain"});
  auto boundary = All<SetBoundary>(out);
  ASSERT_EQ(boundary.size(), 1u);
  EXPECT_EQ(boundary[0].step, 10 + 30);  // 3 s of 0.1 s steps (8 at 0.41 s)
  // b ended at the boundary; a went past it and failed waiting for b; c failed waiting for a.
  EXPECT_EQ(ExitCode(d.Feed(StageReportedDone{DoneAt("b", kRun, 40)})), std::nullopt);
  v1::StageDone a_done =
      Done("a", kRun, "stage 0 (site 'a'): no job r step 40 micro-batch 0 stage 1 BACKWARD tensor 0 from peer 'b'");
  a_done.set_steps(40);
  auto a_failed = d.Feed(StageReportedDone{a_done});
  EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kSwitching) << Printed(a_failed);
  v1::StageDone c_failed = Done("c", kRun, "missed the step boundary 40: heard of it after step 41");
  c_failed.set_steps(41);
  auto out2 = d.Feed(StageReportedDone{c_failed});
  EXPECT_EQ(ExitCode(out2), std::nullopt) << Printed(out2);
  EXPECT_THAT(Printed(out2), HasSubstr("did not all end at step 40; resuming from the newest intact checkpoint"));
  auto assigned = Assignments(out2);
  EXPECT_THAT(Sites(assigned), ElementsAre("a", "b"));
  EXPECT_EQ(assigned["a"].resume_step(), -1);
  EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kTraining);
}

// Stragglers (elastic): a site whose stage computes far more than planned in each of `window` reports is
// re-measured from them and the job re-planned; a big enough gain switches at a step boundary. A slow
// spell shorter than the window triggers nothing.
TEST(RunMachine, ASiteThatStaysSlowIsReplannedAroundAndATransientSlowdownIsNot) {
  RunConfig c = StragglerConfig();
  Driver d(c);
  d.JoinAndProfile({"a", "b", "c"});
  ASSERT_EQ(d.machine().phase(), RunMachine::Phase::kTraining);
  const partitioner::Plan plan = *d.machine().plan();
  ASSERT_GE(plan.stages.size(), 2u);
  // The site of the plan's last stage, and what it should compute per step.
  const partitioner::StagePlan& last = plan.stages.back();
  const std::string site = last.site_names[0];
  // Every used site reports each step; the others compute 1.3x their planned time (what the framework
  // adds to the profile's op times), which is the common ratio the site is compared with.
  auto report = [&](int step, double factor) {
    std::vector<Action> out;
    for (size_t k = 0; k < plan.stages.size(); ++k) {
      const partitioner::StagePlan& st = plan.stages[k];
      for (size_t i = 0; i < st.site_names.size(); ++i) {
        partitioner::SiteProfile p{st.site_names[i], 1e11, 8e9, {}, {}};
        v1::MetricsReport m = Metrics(st.site_names[i], kRun, static_cast<int>(k), step);
        const double own = partitioner::RangeSeconds(c.graph, p, st.first_op, st.last_op) * st.micro_batches[i];
        m.set_compute_seconds(own * 1.3 * (st.site_names[i] == site ? factor : 1.0));
        auto got = d.Feed(MetricsReported{m});
        out.insert(out.end(), got.begin(), got.end());
      }
    }
    return out;
  };
  auto stragglers = [](const std::vector<Action>& out) {
    std::vector<RecordEvent> found;
    for (auto& e : All<RecordEvent>(out))
      if (e.kind == "straggler") found.push_back(e);
    return found;
  };
  std::vector<RecordEvent> events;
  int step = 0;
  for (double f : {1.0, 50.0, 50.0, 50.0, 50.0, 1.02, 1.0, 0.99, 1.01, 1.0})  // 4 slow steps, then normal
    for (auto& e : stragglers(report(step++, f))) events.push_back(e);
  EXPECT_TRUE(events.empty()) << events[0].text;
  EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kTraining);
  std::vector<Action> out;
  for (int i = 0; i < 5; ++i) out = report(step++, 50.0);  // slow in each of the window's 5 steps
  auto straggler = stragglers(out);
  ASSERT_EQ(straggler.size(), 1u) << Printed(out);
  EXPECT_EQ(straggler[0].site, site);
  EXPECT_THAT(
      straggler[0].text,
      HasSubstr(
          "computed 50.00x its planned time (relative to the other sites) in each of its last 5 steps (to step "));
  EXPECT_THAT(straggler[0].text, HasSubstr("faster)"));
  ASSERT_EQ(All<SetBoundary>(out).size(), 1u) << straggler[0].text;  // a 50x slower site: far faster without
  EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kSwitching);
  EXPECT_THAT(Printed(out), HasSubstr("switch: site '" + site + "' computed 50.00x"));
}

// What a site is measured against is the other sites' typical ratio (each the median of its recent
// reports), not their latest: a slowed site is flagged after exactly `window` slow reports although another
// site's step spiked to 4x its planned time in the middle of them (a step preempted on a shared host).
TEST(RunMachine, AnotherSitesSpikeDoesNotHideAStraggler) {
  RunConfig c = StragglerConfig();
  Driver d(c);
  d.JoinAndProfile({"a", "b", "c"});
  const partitioner::Plan plan = *d.machine().plan();
  ASSERT_GE(plan.stages.size(), 2u);
  const std::string slow = plan.stages.back().site_names[0];
  const std::string spiky = plan.stages.front().site_names[0];
  std::vector<RecordEvent> flagged;
  int flagged_at = -1;
  for (int step = 0; step < 10; ++step)
    for (size_t k = 0; k < plan.stages.size(); ++k) {
      const partitioner::StagePlan& st = plan.stages[k];
      partitioner::SiteProfile p{st.site_names[0], 1e11, 8e9, {}, {}};
      v1::MetricsReport m = Metrics(st.site_names[0], kRun, static_cast<int>(k), step);
      double factor = 1.3;                                      // everyone: the framework's share
      if (st.site_names[0] == slow && step >= 5) factor *= 2;   // slowed from step 5 on
      if (st.site_names[0] == spiky && step == 7) factor *= 4;  // one slow step of another site
      m.set_compute_seconds(partitioner::RangeSeconds(c.graph, p, st.first_op, st.last_op) * st.micro_batches[0] *
                            factor);
      for (const auto& e : All<RecordEvent>(d.Feed(MetricsReported{m})))
        if (e.kind == "straggler") flagged.push_back(e), flagged_at = step;
    }
  ASSERT_EQ(flagged.size(), 1u);
  EXPECT_EQ(flagged[0].site, slow);
  EXPECT_EQ(flagged_at, 9) << flagged[0].text;
  EXPECT_THAT(flagged[0].text, HasSubstr("computed 2.00x its planned time (relative to the other sites)"));
}

// A slowdown is seen through one step that ran at full speed (a CPU quota or a shared GPU lets a whole step
// through now and then): `window` slow reports among the latest `window` + 1 flag the site, where a window
// that had to be slow in every step started again at that step. Two full-speed steps in the span do hold
// the flag back until `window` of the latest `window` + 1 are slow again.
TEST(RunMachine, OneFullSpeedStepWithinASlowdownDoesNotStartTheWindowAgain) {
  RunConfig c = StragglerConfig();
  for (const std::set<int>& full_speed : {std::set<int>{7}, std::set<int>{7, 9}}) {
    Driver d(c);
    d.JoinAndProfile({"a", "b", "c"});
    const partitioner::Plan plan = *d.machine().plan();
    ASSERT_GE(plan.stages.size(), 2u);
    const std::string slow = plan.stages.back().site_names[0];
    std::vector<RecordEvent> flagged;
    int flagged_at = -1;
    for (int step = 0; step < 16 && flagged.empty(); ++step)
      for (size_t k = 0; k < plan.stages.size(); ++k) {
        const partitioner::StagePlan& st = plan.stages[k];
        partitioner::SiteProfile p{st.site_names[0], 1e11, 8e9, {}, {}};
        v1::MetricsReport m = Metrics(st.site_names[0], kRun, static_cast<int>(k), step);
        double factor = 1.3;  // everyone: the framework's share
        if (st.site_names[0] == slow && step >= 5 && !full_speed.count(step)) factor *= 2;  // slowed from step 5
        m.set_compute_seconds(partitioner::RangeSeconds(c.graph, p, st.first_op, st.last_op) * st.micro_batches[0] *
                              factor);
        for (const auto& e : All<RecordEvent>(d.Feed(MetricsReported{m})))
          if (e.kind == "straggler") flagged.push_back(e), flagged_at = step;
      }
    ASSERT_EQ(flagged.size(), 1u) << full_speed.size() << " full-speed step(s)";
    EXPECT_EQ(flagged[0].site, slow);
    if (full_speed.size() == 1) {
      EXPECT_EQ(flagged_at, 10) << flagged[0].text;  // steps 5, 6, 8, 9, 10 of 5-10
      EXPECT_THAT(flagged[0].text,
                  HasSubstr("computed 2.00x its planned time (relative to the other sites) in 5 of its last 6 steps"));
    } else {
      EXPECT_EQ(flagged_at, 13) << flagged[0].text;  // steps 8, 10, 11, 12, 13 of 8-13
      EXPECT_THAT(flagged[0].text, HasSubstr("in 5 of its last 6 steps"));
    }
  }
}

// Hysteresis: a site that settles at 1.5x its planned time (relative to the others) is re-measured once;
// the plan over the re-measured profile is no better, so nothing switches, and as it stays at that level
// it is not flagged again and again (its profile now says what it does).
TEST(RunMachine, ASiteSteadyOffItsPlanIsReMeasuredOnceAndDoesNotFlap) {
  RunConfig c = StragglerConfig(200);
  c.spec.elastic.min_gain = 0.9;  // nothing is worth a switch here: the decision alone is under test
  // The site of the last stage (whose reports come in after the others' in each step), then of the first.
  for (const bool last : {true, false}) {
    Driver d(c);
    d.JoinAndProfile({"a", "b", "c"});
    const partitioner::Plan plan = *d.machine().plan();
    ASSERT_GE(plan.stages.size(), 2u);
    const std::string site = (last ? plan.stages.back() : plan.stages.front()).site_names[0];
    int flagged = 0;
    for (int step = 0; step < 60; ++step)
      for (size_t k = 0; k < plan.stages.size(); ++k) {
        const partitioner::StagePlan& st = plan.stages[k];
        partitioner::SiteProfile p{st.site_names[0], 1e11, 8e9, {}, {}};
        v1::MetricsReport m = Metrics(st.site_names[0], kRun, static_cast<int>(k), step);
        // Everyone a little noisy (+-5%); the site steadily 1.5x.
        const double noise = 1 + 0.05 * ((step * 7 + static_cast<int>(k) * 3) % 3 - 1);
        m.set_compute_seconds(partitioner::RangeSeconds(c.graph, p, st.first_op, st.last_op) * st.micro_batches[0] *
                              noise * (st.site_names[0] == site ? 1.5 : 1.0));
        for (const auto& e : All<RecordEvent>(d.Feed(MetricsReported{m})))
          if (e.kind == "straggler") {
            ++flagged;
            EXPECT_EQ(e.site, site);
            EXPECT_THAT(e.text, HasSubstr("no switch"));
          }
      }
    EXPECT_EQ(flagged, 1) << (last ? "the last stage's site" : "the first stage's site");
    EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kTraining);
  }
}

// What `site` reports after measuring at `flops`, with its links to `peers` (both directions).
v1::ProfileReport ProfileAmong(const std::string& site, const std::vector<std::string>& peers, double flops) {
  v1::ProfileReport r;
  r.set_site(site);
  partitioner::ClusterProfile one;
  one.sites.push_back({site, flops, 8e9, {}, {}});
  r.set_site_profile_json(nlohmann::json::parse(partitioner::ProfileToJson(one))["sites"][0].dump());
  r.set_graph_json(partitioner::GraphToJson(SmallGraph()));
  nlohmann::json links = nlohmann::json::array();
  for (const auto& other : peers) {
    links.push_back({{"from", site}, {"to", other}, {"bandwidth_bytes_per_second", 1e9}, {"latency_seconds", 1e-4}});
    links.push_back({{"from", other}, {"to", site}, {"bandwidth_bytes_per_second", 1e9}, {"latency_seconds", 1e-4}});
  }
  r.set_links_json(links.dump());
  return r;
}

// A plan of one site alone has no other site to compare it with: its own first `window` reports under the
// plan set its ratio, and a site that then stays far slower than that is flagged, re-measured and, as the
// idle site is now faster, switched away from.
// A run of up to 100 steps that re-plans as the planner would (not an even split), over two sites or more.
RunConfig TwoSiteConfig() {
  RunConfig c = Config();
  c.even_split = false;
  c.spec.min_sites = 2;
  c.spec.heartbeat_interval_seconds = 0.1;
  c.steps = c.job.steps = 100;
  return c;
}

// Sites a and b register and report profiles at `a_flops` and `b_flops`; a measures the link to b.
void StartTwoSites(Driver* d, double a_flops, double b_flops) {
  d->Feed(RunStarted{});
  d->Feed(SiteRegistered{"a", "127.0.0.1:9a", "cpu"});
  d->Feed(SiteRegistered{"b", "127.0.0.1:9b", "cpu"});
  d->link_bandwidth = 1e9;
  d->link_latency = 1e-4;
  d->Feed(ProfileReported{ProfileAmong("a", {}, a_flops)});
  d->Feed(ProfileReported{ProfileAmong("b", {}, b_flops)});  // then a probes b
}

// A site re-measured from its reports is no reference for the others afterwards: in a plan of two sites,
// one slowed to 3x is flagged and re-measured at 3x; when its slowdown then eases to 2x (a CPU quota's
// swings), it is the one that is off its figures, and the other site, unchanged, is never flagged.
TEST(RunMachine, ASiteReMeasuredFromItsReportsIsNoReferenceForTheOthers) {
  RunConfig c = Config();
  c.even_split = false;
  c.spec.heartbeat_interval_seconds = 0.1;
  c.spec.elastic.drift = 0.3;
  c.spec.elastic.min_gain = 0.9;  // no switch: the decisions alone are under test
  c.steps = c.job.steps = 100;
  c.graph = LargeGraph();
  c.job.replication = false;  // a pipeline of two stages, not replicas
  Driver d(c);
  d.Feed(RunStarted{});
  for (const char* s : {"a", "b", "c"}) d.Feed(SiteRegistered{s, std::string("127.0.0.1:9") + s, "cpu"});
  d.link_bandwidth = 1e9;
  d.link_latency = 1e-4;
  // c a hundred times slower: a plan of a and b.
  for (const char* s : {"a", "b", "c"}) d.Feed(ProfileReported{ProfileAmong(s, {}, s[0] == 'c' ? 1e9 : 1e11)});
  const partitioner::Plan plan = *d.machine().plan();
  ASSERT_EQ(plan.stages.size(), 2u) << partitioner::PlanJson(plan, c.graph);
  const std::string slow = plan.stages.back().site_names[0];
  std::vector<std::pair<int, RecordEvent>> flagged;
  for (int step = 0; step < 25; ++step)
    for (size_t k = 0; k < plan.stages.size(); ++k) {
      const partitioner::StagePlan& st = plan.stages[k];
      partitioner::SiteProfile p{st.site_names[0], 1e11, 8e9, {}, {}};
      v1::MetricsReport m = Metrics(st.site_names[0], kRun, static_cast<int>(k), step);
      const double slowdown = st.site_names[0] != slow ? 1 : step < 5 ? 1 : step < 10 ? 3 : 2;
      m.set_compute_seconds(partitioner::RangeSeconds(c.graph, p, st.first_op, st.last_op) * st.micro_batches[0] * 1.3 *
                            slowdown);
      for (const auto& e : All<RecordEvent>(d.Feed(MetricsReported{m})))
        if (e.kind == "straggler") flagged.emplace_back(step, e);
    }
  ASSERT_FALSE(flagged.empty());
  EXPECT_EQ(flagged[0].first, 9);
  EXPECT_THAT(flagged[0].second.text, HasSubstr("computed 3.00x its planned time"));
  for (const auto& [step, e] : flagged) EXPECT_EQ(e.site, slow) << "at step " << step << ": " << e.text;
}

// Links whose latency needs all four micro-batches in flight at the first stage, and a site a whose memory
// holds only 1F1B's three of them (its state, 525,312 bytes, and 40,960 a micro-batch): the plan recomputes
// stage 1's activations, and a's assignment says so.
TEST(RunMachine, ARecomputingStageIsAssignedSo) {
  Driver d(Config());
  d.link_bandwidth = 1e6;
  d.link_latency = 0.05;
  d.Feed(RunStarted{});
  for (const char* s : {"a", "b", "c"}) d.Feed(SiteRegistered{s, std::string("127.0.0.1:9") + s, "cpu"});
  d.Feed(ProfileReported{Profile("b")});
  d.Feed(ProfileReported{Profile("c")});
  auto planned = d.Feed(ProfileReported{Profile("a", "", 525312 + 3 * 40960 + 1000)});
  ASSERT_EQ(d.machine().phase(), RunMachine::Phase::kTraining) << Printed(planned);
  const partitioner::Plan plan = *d.machine().plan();
  ASSERT_EQ(plan.stages.size(), 3u);
  EXPECT_TRUE(plan.stages[0].recompute);
  EXPECT_EQ(plan.stages[0].in_flight, 4);
  EXPECT_FALSE(plan.stages[1].recompute);
  auto assigned = Assignments(d.last());
  ASSERT_THAT(Sites(assigned), ElementsAre("a", "b", "c"));
  EXPECT_TRUE(assigned["a"].recompute());
  EXPECT_EQ(assigned["a"].in_flight(), 4);
  EXPECT_FALSE(assigned["b"].recompute());
  bool written = false;
  for (const auto& f : All<WriteRunFile>(d.last()))
    if (f.name == core::kPlanFile) written = nlohmann::json::parse(f.content)["stages"][0]["recompute"].get<bool>();
  EXPECT_TRUE(written);
}

// The spec's `memory:` of a site caps what its device reports: the same site a, reporting 8 GB free but
// capped at what holds 1F1B's three micro-batches, gets the recomputing stage, and profile.json says the cap.
TEST(RunMachine, TheSpecsMemoryCapIsWhatThePlannerSees) {
  RunConfig c = Config();
  c.spec.sites[0].memory_bytes = 525312 + 3 * 40960 + 1000;
  Driver d(c);
  d.link_bandwidth = 1e6;
  d.link_latency = 0.05;
  d.JoinAndProfile({"a", "b", "c"});
  ASSERT_EQ(d.machine().phase(), RunMachine::Phase::kTraining) << Printed(d.last());
  const partitioner::Plan plan = *d.machine().plan();
  ASSERT_EQ(plan.stages.size(), 3u);
  EXPECT_TRUE(plan.stages[0].recompute);
  EXPECT_LE(plan.stages[0].memory_available_bytes, 525312 + 3 * 40960 + 1000);
  EXPECT_FALSE(plan.stages[1].recompute);
  int profiled = 0;  // sites in profile.json
  for (const auto& f : All<WriteRunFile>(d.last()))
    if (f.name == core::kProfileFile) {
      const auto profile = nlohmann::json::parse(f.content);  // kept: the loop below reads into it
      for (const auto& s : profile["sites"]) {
        ++profiled;
        EXPECT_EQ(s["memory_bytes"].get<double>(), s["name"] == "a" ? 525312 + 3 * 40960 + 1000 : 8e9) << s.dump();
      }
    }
  EXPECT_EQ(profiled, 3);
}

// A profile measured before: three sites of Config()'s spec, each op timed, every link both ways.
partitioner::ClusterProfile GivenProfile() {
  partitioner::ClusterProfile p;
  for (const char* site : {"a", "b", "c"}) {
    partitioner::SiteProfile sp{site, 1e11, 8e9, {}, {}};
    sp.device = "cpu";
    for (const auto& op : SmallGraph().ops) sp.op_seconds[op.name] = 0.001;
    p.sites.push_back(sp);
  }
  for (const char* from : {"a", "b", "c"})
    for (const char* to : {"a", "b", "c"})
      if (std::string(from) != to) p.links.push_back({from, to, 1e7, 0.02});
  return p;
}

// Starts the run and lets `sites` register, each on "cpu"; every action the machine answered, in order.
std::vector<Action> StartAndRegister(Driver* d, const std::vector<std::string>& sites) {
  std::vector<Action> all = d->Feed(RunStarted{});
  for (const auto& s : sites) {
    auto out = d->Feed(SiteRegistered{s, "127.0.0.1:9" + s, "cpu"});
    all.insert(all.end(), out.begin(), out.end());
  }
  return all;
}

// --profile: the run plans from the given figures as soon as the sites have joined, asking none of them to
// measure anything, and profile.json is what it was given (the sites that joined, the links between them).
TEST(RunMachine, AGivenProfileIsPlannedFromWithoutMeasuringAnything) {
  RunConfig c = Config();
  c.given_profile = GivenProfile();
  c.given_profile_path = "/runs/before/profile.json";
  Driver d(c);
  d.answer_link_probes = false;  // none may be asked for
  const std::vector<Action> all = StartAndRegister(&d, {"a", "b", "c"});
  EXPECT_TRUE(Profiles(all).empty());
  ASSERT_EQ(d.machine().phase(), RunMachine::Phase::kTraining) << Printed(all);
  EXPECT_THAT(Printed(all), HasSubstr("planning from /runs/before/profile.json"));
  EXPECT_EQ(Assignments(all).size(), 3u);
  int written = 0;
  for (const auto& f : All<WriteRunFile>(all))
    if (f.name == core::kProfileFile) {
      ++written;
      EXPECT_EQ(nlohmann::json::parse(f.content), nlohmann::json::parse(partitioner::ProfileToJson(GivenProfile())));
    }
  EXPECT_EQ(written, 1);
  bool noted = false;
  for (const auto& e : All<RecordEvent>(all))
    if (e.kind == "profiled") {
      noted = true;
      EXPECT_THAT(e.text, HasSubstr("from /runs/before/profile.json (not measured again)"));
    }
  EXPECT_TRUE(noted);
}

// With min_sites, the sites that joined are planned from their given figures and the links to one that
// did not are left out; once it registers it is measured as any site joining mid-run (its given figures
// unused), with its links to the running sites.
TEST(RunMachine, AGivenProfilePlansOnlyTheSitesThatJoined) {
  RunConfig c = Config();
  c.spec.min_sites = 2;
  c.given_profile = GivenProfile();
  c.given_profile_path = "p.json";
  Driver d(c);
  const std::vector<Action> out = StartAndRegister(&d, {"a", "b"});
  ASSERT_EQ(d.machine().phase(), RunMachine::Phase::kTraining) << Printed(out);
  EXPECT_TRUE(Profiles(out).empty());
  int written = 0;
  for (const auto& f : All<WriteRunFile>(out))
    if (f.name == core::kProfileFile) {
      ++written;
      const auto j = nlohmann::json::parse(f.content);
      EXPECT_EQ(j["sites"].size(), 2u) << f.content;
      EXPECT_EQ(j["links"].size(), 2u) << f.content;
      for (const auto& l : j["links"]) EXPECT_TRUE(l["from"] != "c" && l["to"] != "c") << l.dump();
    }
  EXPECT_EQ(written, 1);
  d.Feed(SiteRegistered{"c", "127.0.0.1:9c", "cpu"});
  std::vector<SendCommand> asked;
  for (int i = 0; i < 10 && asked.empty(); ++i) asked = Profiles(d.Feed(Tick{}, 1.0));
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(asked[0].site, "c");
  EXPECT_FALSE(asked[0].command.profile().links_only());  // its device and the model too
  std::set<std::string> peers;
  for (const auto& p : asked[0].command.profile().peers()) peers.insert(p.site());
  EXPECT_EQ(peers, (std::set<std::string>{"a", "b"}));
}

// A given profile plans exactly as the same figures measured by the sites would.
TEST(RunMachine, AGivenProfilePlansAsTheSameFiguresMeasured) {
  RunConfig c = StragglerConfig();  // the planner's layout of LargeGraph over a, b, c
  Driver measured(c);
  measured.JoinAndProfile({"a", "b", "c"});  // each 1e11 FLOP/s and 8e9 bytes, links 1e8 B/s and 1 ms
  ASSERT_EQ(measured.machine().phase(), RunMachine::Phase::kTraining);
  partitioner::ClusterProfile same;
  for (const char* site : {"a", "b", "c"}) same.sites.push_back({site, 1e11, 8e9, {}, {}});
  for (const char* from : {"a", "b", "c"})
    for (const char* to : {"a", "b", "c"})
      if (std::string(from) != to) same.links.push_back({from, to, 1e8, 1e-3});
  c.given_profile = same;
  c.given_profile_path = "p.json";
  Driver given(c);
  StartAndRegister(&given, {"a", "b", "c"});
  ASSERT_EQ(given.machine().phase(), RunMachine::Phase::kTraining);
  const partitioner::Plan& want = *measured.machine().plan();
  const partitioner::Plan& got = *given.machine().plan();
  ASSERT_GE(want.stages.size(), 2u);  // a pipeline: the cuts and their order matter
  ASSERT_EQ(got.stages.size(), want.stages.size());
  for (size_t k = 0; k < want.stages.size(); ++k) {
    EXPECT_EQ(got.stages[k].site_names, want.stages[k].site_names) << k;
    EXPECT_EQ(got.stages[k].last_op, want.stages[k].last_op) << k;
  }
  EXPECT_DOUBLE_EQ(got.predicted_step_seconds, want.predicted_step_seconds);
}

// A site whose figures were measured on another device than it registers with is refused: the run fails
// naming the file, the site and both devices.
TEST(RunMachine, AGivenProfileOfAnotherDeviceFailsTheRun) {
  RunConfig c = Config();
  c.given_profile = GivenProfile();
  c.given_profile->sites[1].device = "cuda:0";
  c.given_profile_path = "p.json";
  Driver d(c);
  const std::vector<Action> all = StartAndRegister(&d, {"a", "b", "c"});
  EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kFinished);
  EXPECT_THAT(Printed(all),
              HasSubstr("--profile p.json: site 'b' was measured on cuda:0 but registered with device cpu"));
  ASSERT_EQ(All<Exit>(all).size(), 1u);
  EXPECT_EQ(All<Exit>(all)[0].code, 1);
  EXPECT_TRUE(Assignments(all).empty());
}

// CheckGivenProfile: the spec's sites and no other, their devices, the job's ops and no other, a link each
// way between every two; errors name the file and the site, op or link. The spec's memory cap applies.
TEST(RunMachine, AGivenProfileIsCheckedAgainstTheSpecAndTheModel) {
  const RunConfig c = Config();
  partitioner::ClusterProfile usable;
  core::ClusterSpec capped = c.spec;
  capped.sites[1].memory_bytes = 1e9;
  ASSERT_TRUE(CheckGivenProfile(GivenProfile(), "p.json", capped, c.graph, &usable).ok());
  ASSERT_EQ(usable.sites.size(), 3u);
  EXPECT_EQ(usable.sites[1].memory_bytes, 1e9);
  EXPECT_EQ(usable.sites[0].memory_bytes, 8e9);
  EXPECT_EQ(usable.links.size(), 6u);
  partitioner::ClusterProfile by_flops = GivenProfile();  // no op times: priced by FLOPs
  for (auto& s : by_flops.sites) s.op_seconds.clear();
  EXPECT_TRUE(CheckGivenProfile(by_flops, "p.json", c.spec, c.graph, &usable).ok());

  auto error = [&](const std::function<void(partitioner::ClusterProfile&)>& edit) {
    partitioner::ClusterProfile p = GivenProfile();
    edit(p);
    const absl::Status s = CheckGivenProfile(p, "p.json", c.spec, c.graph, &usable);
    EXPECT_FALSE(s.ok());
    return std::string(s.message());
  };
  EXPECT_THAT(error([](auto& p) { p.sites.pop_back(); }),
              HasSubstr("--profile p.json: site 'c' of the cluster spec is not in it"));
  EXPECT_THAT(error([](auto& p) {
                p.sites.push_back({"d", 1e11, 8e9, {}, {}});
              }),
              HasSubstr("--profile p.json: site 'd' is not in the cluster spec"));
  EXPECT_THAT(error([](auto& p) { p.sites[1].workers = 2; }),
              HasSubstr("--profile p.json: site 'b': it reports 2 workers, but the spec gives it 1 device(s)"));
  EXPECT_THAT(error([](auto& p) { p.sites[0].op_seconds["layer9.mlp"] = 0.1; }),
              HasSubstr("--profile p.json: site 'a': op 'layer9.mlp' is not in the job's model"));
  const std::string first_op = c.graph.ops[0].name;
  EXPECT_THAT(error([&](auto& p) { p.sites[2].op_seconds.erase(first_op); }),
              HasSubstr("site 'c' has no time for op '" + first_op + "' of the job's model"));
  EXPECT_THAT(error([](auto& p) { p.links.pop_back(); }), HasSubstr("it has no link c -> b"));
  EXPECT_THAT(error([](auto& p) {
                p.links.push_back({"a", "z", 1e7, 0.02});
              }),
              HasSubstr("link a -> z is not between two sites of the cluster spec"));
  EXPECT_THAT(error([](auto& p) { p.links.push_back(p.links[0]); }), HasSubstr("link a -> b is given twice"));
}

// `meridian run --resume` continues from whatever the shared directory holds: its assignments name no run
// to match (a fresh run's name its own, above).
TEST(RunMachine, AResumedRunLoadsTheNewestCheckpointOfAnyRun) {
  RunConfig c = Config();
  c.resume = true;
  Driver d(c);
  d.JoinAndProfile({"a", "b", "c"});
  ASSERT_EQ(d.machine().phase(), RunMachine::Phase::kTraining);
  auto assigned = Assignments(d.last());
  ASSERT_FALSE(assigned.empty());
  for (const auto& [site, a] : assigned) {
    EXPECT_EQ(a.resume_step(), -1) << site;
    EXPECT_EQ(a.resume_run(), "") << site;
  }
}

TEST(RunMachine, ASiteAloneInThePlanIsMeasuredAgainstItsOwnFirstSteps) {
  const RunConfig c = TwoSiteConfig();
  Driver d(c);
  StartTwoSites(&d, 1e11, 1e9);
  ASSERT_EQ(d.machine().phase(), RunMachine::Phase::kTraining);
  const partitioner::Plan plan = *d.machine().plan();
  ASSERT_EQ(plan.stages.size(), 1u);
  ASSERT_THAT(plan.stages[0].site_names, ElementsAre("a"));
  const partitioner::StagePlan& st = plan.stages[0];
  partitioner::SiteProfile p{"a", 1e11, 8e9, {}, {}};
  const double planned = partitioner::RangeSeconds(c.graph, p, st.first_op, st.last_op) * st.micro_batches[0];
  auto report = [&](int step, double factor) {
    v1::MetricsReport m = Metrics("a", kRun, 0, step);
    m.set_compute_seconds(planned * factor);
    return d.Feed(MetricsReported{m});
  };
  auto stragglers = [](const std::vector<Action>& out) {
    std::vector<RecordEvent> found;
    for (auto& e : All<RecordEvent>(out))
      if (e.kind == "straggler") found.push_back(e);
    return found;
  };
  int step = 0;
  // Its first step warms up (3x); the next five at 1.3x the profile (the framework's share) set its ratio;
  // steady at that, and a slow spell shorter than the window, change nothing.
  for (double f : {3.0, 1.3, 1.32, 1.28, 1.3, 1.31, 1.3, 1.29, 1.3, 1.3, 1.31, 130.0, 130.0, 1.3, 1.3, 1.3, 1.3, 1.3})
    EXPECT_TRUE(stragglers(report(step++, f)).empty()) << "step " << step;
  // Faster than its own start is not flagged (measured against itself, a site whose speed swings would
  // flap between slower and faster); a slower spell of a window is.
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(stragglers(report(step++, 0.5)).empty()) << "step " << step;
  std::vector<Action> out;
  for (int i = 0; i < 5; ++i) out = report(step++, 130.0);  // 100x its own ratio in each of the window's steps
  auto flagged = stragglers(out);
  ASSERT_EQ(flagged.size(), 1u) << Printed(out);
  EXPECT_EQ(flagged[0].site, "a");
  EXPECT_THAT(flagged[0].text, HasSubstr("computed 100.00x its planned time (relative to its first steps under this "
                                         "plan) in each of its last 5 steps"));
  // b, 100x slower than a was, would be faster now; it has been idle since it was measured, so it is
  // measured again first, training going on, and the switch is decided with its new figures.
  EXPECT_TRUE(All<SetBoundary>(out).empty()) << Printed(out);
  auto commands = All<SendCommand>(out);
  ASSERT_EQ(commands.size(), 1u) << Printed(out);
  EXPECT_EQ(commands[0].site, "b");
  ASSERT_TRUE(commands[0].command.has_profile());
  EXPECT_EQ(commands[0].command.profile().peers_size(), 0);  // its links stand
  EXPECT_THAT(Printed(out), HasSubstr("measuring 'b' again first"));
  // Measured again as before: the switch goes ahead.
  auto remeasured = d.Feed(ProfileReported{ProfileAmong("b", {}, 1e9)});
  ASSERT_EQ(All<SetBoundary>(remeasured).size(), 1u) << Printed(remeasured);
  EXPECT_THAT(Printed(remeasured), HasSubstr("measured again, a new plan predicts"));
  EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kSwitching);
}

// The same, but the idle site measures far slower than its figures from the start said (a profile taken
// while every emulated site measured at once): the straggler stays where it is.
TEST(RunMachine, AStragglersSwitchOntoAnIdleSiteWaitsForItsNewMeasurement) {
  const RunConfig c = TwoSiteConfig();
  Driver d(c);
  StartTwoSites(&d, 1e11, 1e9);
  ASSERT_EQ(d.machine().phase(), RunMachine::Phase::kTraining);
  const partitioner::StagePlan st = d.machine().plan()->stages[0];
  partitioner::SiteProfile p{"a", 1e11, 8e9, {}, {}};
  const double planned = partitioner::RangeSeconds(c.graph, p, st.first_op, st.last_op) * st.micro_batches[0];
  std::vector<Action> out;
  int step = 0;
  for (double f : {3.0, 1.3, 1.3, 1.3, 1.3, 1.3}) {
    v1::MetricsReport m = Metrics("a", kRun, 0, step++);
    m.set_compute_seconds(planned * f);
    d.Feed(MetricsReported{m});
  }
  for (int i = 0; i < 5; ++i) {
    v1::MetricsReport m = Metrics("a", kRun, 0, step++);
    m.set_compute_seconds(planned * 130);
    out = d.Feed(MetricsReported{m});
  }
  ASSERT_EQ(All<SendCommand>(out).size(), 1u) << Printed(out);
  // While b is measured again, the reports are left out of the straggler checks (on a shared host the
  // measurement computes beside them): a's steps 130x slower again flag nothing and wait for nothing.
  for (int i = 0; i < 5; ++i) {
    v1::MetricsReport m = Metrics("a", kRun, 0, step++);
    m.set_compute_seconds(planned * 130 * 130);
    out = d.Feed(MetricsReported{m});
    EXPECT_TRUE(All<SetBoundary>(out).empty()) << Printed(out);
    EXPECT_TRUE(All<SendCommand>(out).empty()) << Printed(out);
    for (const auto& e : All<RecordEvent>(out)) EXPECT_NE(e.kind, "straggler") << e.text;
  }
  auto remeasured = d.Feed(ProfileReported{ProfileAmong("b", {}, 1e3)});  // a million times slower than thought
  EXPECT_TRUE(All<SetBoundary>(remeasured).empty()) << Printed(remeasured);
  EXPECT_THAT(Printed(remeasured), HasSubstr("not above elastic.min_gain"));
  EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kTraining);
  // A profile nobody asked for any more is not taken.
  auto again = d.Feed(ProfileReported{ProfileAmong("b", {}, 1e15)});
  EXPECT_TRUE(All<SetBoundary>(again).empty());
  ASSERT_EQ(All<LogSite>(again).size(), 1u);
  EXPECT_THAT(All<LogSite>(again)[0].text, HasSubstr("nobody asked for"));
}

// A switch for speed is checked against what it then measures. a, alone in the plan, slows down 100x; b,
// measured again, is switched to (a replica beside a). The new plan's steps then run `new_step` seconds
// against the 1 s a's last ones took. Returns the driver after the new plan's first `window` + 1 steps
// (its first warms up) and sets *boundary to the switch's step.
std::unique_ptr<Driver> SwitchToBAndRun(double new_step, int64_t* boundary) {
  const RunConfig c = TwoSiteConfig();
  auto d = std::make_unique<Driver>(c);
  StartTwoSites(d.get(), 1e11, 1e9);
  const partitioner::StagePlan st = d->machine().plan()->stages[0];
  EXPECT_THAT(st.site_names, ElementsAre("a"));
  partitioner::SiteProfile p{"a", 1e11, 8e9, {}, {}};
  const double planned = partitioner::RangeSeconds(c.graph, p, st.first_op, st.last_op) * st.micro_batches[0];
  int step = 0;
  auto a_step = [&](double factor, double seconds) {
    v1::MetricsReport m = Metrics("a", kRun, 0, step++);
    m.set_compute_seconds(planned * factor);
    m.set_step_seconds(seconds);
    return d->Feed(MetricsReported{m});
  };
  for (double f : {3.0, 1.3, 1.3, 1.3, 1.3, 1.3}) a_step(f, 0.01);
  for (int i = 0; i < 4; ++i) a_step(130, 1.0);
  EXPECT_EQ(All<SendCommand>(a_step(130, 1.0)).size(), 1u);  // b is measured again
  for (int i = 0; i < 3; ++i) a_step(130, 9.0);  // its measuring shares the cores: left out of the comparison
  auto remeasured = d->Feed(ProfileReported{ProfileAmong("b", {}, 1e9)});
  auto set = All<SetBoundary>(remeasured);
  EXPECT_EQ(set.size(), 1u) << Printed(remeasured);
  if (set.empty()) return d;
  *boundary = set[0].step;
  a_step(130, 9.0);  // the step the answer came in
  while (step < *boundary) a_step(130, 1.0);
  auto switched = d->Feed(StageReportedDone{DoneAt("a", kRun, *boundary)});
  EXPECT_THAT(Sites(Assignments(switched)), ElementsAre("a", "b")) << Printed(switched);
  EXPECT_THAT(d->machine().plan()->stages[0].site_names, ElementsAre("a", "b"));
  const std::string job = d->machine().job_id();
  for (int i = 0; i <= c.spec.elastic.window; ++i) {  // a, replica 0, reports the step
    v1::MetricsReport m = Metrics("a", job, 0, static_cast<int>(*boundary) + i);
    m.set_step_seconds(i == 0 ? 5.0 : new_step);  // its first step warms up
    d->Feed(MetricsReported{m});
  }
  return d;
}

TEST(RunMachine, ASwitchForSpeedThatRunsSlowerIsSwitchedBackAndNotTakenAgain) {
  int64_t boundary = 0;
  auto d = SwitchToBAndRun(1.5, &boundary);
  const std::vector<Action> out = d->last();
  std::vector<RecordEvent> checks;
  for (const auto& e : All<RecordEvent>(out))
    if (e.kind == "switch_check") checks.push_back(e);
  ASSERT_EQ(checks.size(), 1u) << Printed(out);
  EXPECT_THAT(checks[0].text, HasSubstr("the switch to a+b ran a median 1.5000 s a step over its steps " +
                                        std::to_string(boundary + 2) + "-" + std::to_string(boundary + 6)));
  EXPECT_THAT(checks[0].text, HasSubstr("against 1.0000 s for a before it: the plan before was 33% faster"));
  EXPECT_THAT(checks[0].text, HasSubstr("switching back to a, and no switch for speed onto 'a', 'b' again"));
  auto set = All<SetBoundary>(out);
  ASSERT_EQ(set.size(), 1u) << Printed(out);
  EXPECT_EQ(d->machine().phase(), RunMachine::Phase::kSwitching);
  // The next attempt runs a's layout again, from the boundary.
  d->Feed(StageReportedDone{DoneAt("a", d->machine().job_id(), set[0].step)});
  auto back = d->Feed(StageReportedDone{DoneAt("b", d->machine().job_id(), set[0].step)});
  auto assigned = Assignments(back);
  EXPECT_THAT(Sites(assigned), ElementsAre("a")) << Printed(back);
  for (const auto& [site, a] : assigned) EXPECT_EQ(a.resume_step(), set[0].step);
  EXPECT_THAT(d->machine().plan()->stages[0].site_names, ElementsAre("a"));
  // a is slow again in each of a window's steps: a new plan would again add b, which is refused.
  const std::string job = d->machine().job_id();
  std::vector<Action> flagged;
  for (int i = 0; i < 12; ++i) {
    v1::MetricsReport m = Metrics("a", job, 0, static_cast<int>(set[0].step) + i);
    m.set_compute_seconds(i < 6 ? 1e-3 : 2e-3);  // its baseline, then twice that
    auto got = d->Feed(MetricsReported{m});
    flagged.insert(flagged.end(), got.begin(), got.end());
  }
  EXPECT_TRUE(All<SetBoundary>(flagged).empty()) << Printed(flagged);
  EXPECT_TRUE(All<SendCommand>(flagged).empty()) << Printed(flagged);  // b is not even measured again
  EXPECT_THAT(Printed(flagged), HasSubstr("a switch onto these sites measured slower than the plan before it earlier "
                                          "in this run: no switch"));
  EXPECT_EQ(d->machine().phase(), RunMachine::Phase::kTraining);
}

TEST(RunMachine, ASwitchForSpeedThatRunsFasterIsKeptAndSaysSo) {
  int64_t boundary = 0;
  auto d = SwitchToBAndRun(0.5, &boundary);
  EXPECT_TRUE(All<SetBoundary>(d->last()).empty()) << Printed(d->last());
  EXPECT_EQ(d->machine().phase(), RunMachine::Phase::kTraining);
  std::vector<RecordEvent> checks;
  for (const auto& e : All<RecordEvent>(d->last()))
    if (e.kind == "switch_check") checks.push_back(e);
  ASSERT_EQ(checks.size(), 1u) << Printed(d->last());
  EXPECT_THAT(checks[0].text, HasSubstr("ran a median 0.5000 s a step"));
  EXPECT_THAT(checks[0].text, HasSubstr("against 1.0000 s for a before it: 50% faster"));
  // Slower, but within min_gain (10%): kept too.
  auto kept = SwitchToBAndRun(1.05, &boundary);
  EXPECT_TRUE(All<SetBoundary>(kept->last()).empty()) << Printed(kept->last());
  EXPECT_THAT(Printed(kept->last()), HasSubstr("5% slower, within elastic.min_gain; kept"));
}

// A site of the spec that registers after training started is measured while training goes on (the
// running sites first admit its probes), and a plan over every site that is faster by more than
// min_gain is switched to at a step boundary; the new attempt runs on it and resumes from that step.
TEST(RunMachine, ASiteJoiningMidRunIsMeasuredAndSwitchedToWhenThatPays) {
  const RunConfig c = TwoSiteConfig();
  Driver d(c);
  StartTwoSites(&d, 1e9, 1e9);
  ASSERT_EQ(d.machine().phase(), RunMachine::Phase::kTraining);
  d.Feed(MetricsReported{Metrics("a", kRun, 0, 9)});
  auto joined = d.Feed(SiteRegistered{"c", "127.0.0.1:9c", "cpu"});
  auto probers = All<SetProbers>(joined);
  ASSERT_EQ(probers.size(), 1u);
  EXPECT_EQ(probers[0].sites, (std::set<std::string>{"c"}));
  EXPECT_THAT(Printed(joined), HasSubstr("join: site 'c' joined mid-run; measuring it while training goes on"));
  EXPECT_TRUE(All<SendCommand>(joined).empty());  // not before the running sites admit its probes
  auto asked = d.Feed(Tick{}, 0.3);
  auto commands = All<SendCommand>(asked);
  ASSERT_EQ(commands.size(), 1u);
  EXPECT_EQ(commands[0].site, "c");
  ASSERT_TRUE(commands[0].command.has_profile());
  ASSERT_EQ(commands[0].command.profile().peers_size(), 2);  // every running site
  // c is ten times faster than a and b: a plan with it is far faster.
  auto measured = d.Feed(ProfileReported{ProfileAmong("c", {"a", "b"}, 1e10)});
  auto boundary = All<SetBoundary>(measured);
  ASSERT_EQ(boundary.size(), 1u) << Printed(measured);
  EXPECT_THAT(Printed(measured), HasSubstr("switch: site 'c' joined: a plan over 3 sites predicts"));
  EXPECT_EQ(All<SetProbers>(measured).size(), 1u);  // no prober any more
  d.Feed(StageReportedDone{DoneAt("a", kRun, boundary[0].step)});
  auto switched = d.Feed(StageReportedDone{DoneAt("b", kRun, boundary[0].step)});
  auto assigned = Assignments(switched);
  EXPECT_TRUE(assigned.count("c")) << Printed(switched);
  for (const auto& [site, a] : assigned) EXPECT_EQ(a.resume_step(), boundary[0].step) << site;
}

// A joiner asked to measure that keeps its heartbeat but never answers is dropped after 300 s (the
// straggler checks, which pause while a site measures itself mid-run, would otherwise never resume).
TEST(RunMachine, AJoinerThatNeverAnswersItsMeasurementIsDropped) {
  const RunConfig c = TwoSiteConfig();
  Driver d(c);
  StartTwoSites(&d, 1e9, 1e9);
  ASSERT_EQ(d.machine().phase(), RunMachine::Phase::kTraining);
  d.Feed(MetricsReported{Metrics("a", kRun, 0, 9)});
  d.Feed(SiteRegistered{"c", "127.0.0.1:9c", "cpu"});
  ASSERT_EQ(All<SendCommand>(d.Feed(Tick{}, 0.3)).size(), 1u);  // asked
  EXPECT_TRUE(Printed(d.Feed(Tick{}, 250)).empty());
  auto dropped = d.Feed(Tick{}, 51);
  EXPECT_THAT(Printed(dropped), HasSubstr("join: site 'c': did not answer its measurement within 300 s"));
  EXPECT_EQ(All<SetProbers>(dropped).size(), 1u);  // no prober any more
  EXPECT_TRUE(All<SendCommand>(d.Feed(Tick{}, 10)).empty()) << "not asked again until it registers again";
  auto late = d.Feed(ProfileReported{ProfileAmong("c", {"a", "b"}, 1e10)});
  EXPECT_TRUE(All<SetBoundary>(late).empty()) << Printed(late);
  EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kTraining);
}

TEST(RunMachine, SurvivorsThatNeverAnswerAreWaitedForAtMostTheDrainTime) {
  Driver d(Config());
  d.JoinAndProfile({"a", "b", "c"});
  d.Feed(HeartbeatLost{"b"});
  EXPECT_TRUE(Assignments(d.Feed(Tick{}, 74)).empty());
  EXPECT_THAT(Sites(Assignments(d.Feed(Tick{}, 2))), ElementsAre("a", "c"));
}

TEST(RunMachine, LostSiteWithWaitResumesWhenItAnswersAgain) {
  Driver d(Config(core::OnFailure::kWait));
  d.JoinAndProfile({"a", "b", "c"});
  d.Feed(HeartbeatLost{"c"});
  d.Feed(StageReportedDone{Done("a", kRun, "stream broke")});
  auto waiting = d.Feed(StageReportedDone{Done("b", kRun, "stream broke")});
  EXPECT_THAT(Printed(waiting), HasSubstr("recovery: waiting for 'c' to rejoin (on_failure: wait)"));
  EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kWaitingForReturn);
  EXPECT_TRUE(Assignments(d.Feed(Tick{}, 60)).empty());  // as long as it takes

  // The restarted executor registers again (perhaps elsewhere), then heartbeats.
  d.Feed(SiteRegistered{"c", "127.0.0.1:9999", "cpu"});
  auto back = d.Feed(HeartbeatBack{"c"});
  EXPECT_THAT(Printed(back), HasSubstr("recovery: 'c' answering again; resuming from the newest intact checkpoint"));
  auto assigned = Assignments(back);
  EXPECT_THAT(Sites(assigned), ElementsAre("a", "b", "c"));
  EXPECT_EQ(assigned["b"].next_address(), "127.0.0.1:9999");
  EXPECT_EQ(assigned["c"].resume_step(), -1);
  EXPECT_EQ(assigned["c"].job_id(), "r-1");
}

TEST(RunMachine, APinnedPlanThatLosesASiteIsDroppedForAPlanOverTheSitesLeft) {
  RunConfig c = Config();
  c.even_split = false;
  c.plan_path = "pinned.json";
  c.pinned = {{{"c"}, 1}, {{"b"}, 3}, {{"a"}, 5}};
  Driver d(c);
  d.JoinAndProfile({"a", "b", "c"});
  auto first = Assignments(d.last());
  ASSERT_THAT(Sites(first), ElementsAre("a", "b", "c"));
  EXPECT_EQ(first["c"].stage(), 0);  // the pinned order, not the spec's
  EXPECT_EQ(first["a"].stage(), 2);

  d.Feed(HeartbeatLost{"b"});
  d.Feed(StageReportedDone{Done("a", kRun, "broke")});
  auto replanned = d.Feed(StageReportedDone{Done("c", kRun, "broke")});
  EXPECT_THAT(
      Printed(replanned),
      HasSubstr("plan: the pinned plan (pinned.json) uses site 'b', which is lost; planning over the sites left"));
  for (const auto& [site, a] : Assignments(replanned)) EXPECT_NE(site, "b");
  EXPECT_FALSE(Assignments(replanned).empty());
}

TEST(RunMachine, ASiteLostWhileProfilingFailsTheRun) {
  Driver d(Config());
  d.Feed(RunStarted{});
  for (const char* s : {"a", "b", "c"}) d.Feed(SiteRegistered{s, "x", "cpu"});
  d.Feed(ProfileReported{Profile("a")});
  auto out = d.Feed(HeartbeatLost{"b"});
  EXPECT_EQ(ExitCode(out), 1);
  EXPECT_THAT(Printed(out), HasSubstr("meridian run: site 'b' stopped answering"));
  EXPECT_EQ(All<StopAll>(out).size(), 1u);
}

TEST(RunMachine, AProfilingErrorFailsTheRunNamingTheSite) {
  Driver d(Config());
  d.Feed(RunStarted{});
  for (const char* s : {"a", "b", "c"}) d.Feed(SiteRegistered{s, "x", "cpu"});
  d.Feed(ProfileReported{Profile("a")});
  d.Feed(ProfileReported{Profile("b", "profiling the model: out of memory")});
  auto out = d.Feed(ProfileReported{Profile("c")});
  EXPECT_EQ(ExitCode(out), 1);
  EXPECT_THAT(Printed(out), HasSubstr("site 'b' could not profile: profiling the model: out of memory"));
}

TEST(RunMachine, ALostSiteWithoutCheckpointsFailsTheRun) {
  RunConfig c = Config();
  c.job.checkpoint.interval = 0;
  Driver d(c);
  d.JoinAndProfile({"a", "b", "c"});
  auto out = d.Feed(HeartbeatLost{"a"});
  EXPECT_EQ(ExitCode(out), 1);
  EXPECT_THAT(Printed(out), HasSubstr("The job has no checkpoints (job.checkpoint.interval)"));
}

TEST(RunMachine, AStageFailureIsSaidAtOnceAndEndsTheRunWhenNoSiteWentSilent) {
  Driver d(Config());
  d.JoinAndProfile({"a", "b", "c"});
  auto failed = d.Feed(StageReportedDone{Done("b", kRun, "stage 1 (site 'b'): out of memory: not enough memory")});
  EXPECT_THAT(Printed(failed), HasSubstr("stage 1 at site 'b' failed: stage 1 (site 'b'): out of memory"));
  EXPECT_FALSE(ExitCode(failed));  // heartbeats get the time to name a site that died
  EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kFailing);
  EXPECT_FALSE(ExitCode(d.Feed(Tick{}, 5.5)));
  auto out = d.Feed(Tick{}, 1);
  EXPECT_EQ(ExitCode(out), 1);
  EXPECT_THAT(Printed(out), HasSubstr("meridian run: site 'b' failed: stage 1 (site 'b'): out of memory"));
}

TEST(RunMachine, AStageFailureThenASilentSiteIsRecovered) {
  Driver d(Config());
  d.JoinAndProfile({"a", "b", "c"});
  d.Feed(StageReportedDone{Done("a", kRun, "stream to peer 'b' broke")});
  auto lost = d.Feed(HeartbeatLost{"b"}, 2);
  EXPECT_THAT(Printed(lost),
              HasSubstr("lost: site 'b' stopped answering (no heartbeat for 5 s); then site 'a' failed"));
  auto replanned = d.Feed(StageReportedDone{Done("c", kRun, "broke")});
  EXPECT_THAT(Sites(Assignments(replanned)), ElementsAre("a", "c"));
}

TEST(RunMachine, LateReportsOfAnAbandonedAttemptChangeNothing) {
  Driver d(Config());
  d.JoinAndProfile({"a", "b", "c"});
  d.Feed(HeartbeatLost{"b"});
  d.Feed(StageReportedDone{Done("a", kRun, "broke")});
  d.Feed(StageReportedDone{Done("c", kRun, "broke")});
  ASSERT_EQ(d.machine().job_id(), "r-1");
  // The lost site's process was only slow: its reports of attempt "r" arrive now.
  auto late = d.Feed(StageReportedDone{Done("b", kRun, "peer 'a' went away")});
  EXPECT_FALSE(ExitCode(late));
  EXPECT_TRUE(Assignments(late).empty());
  EXPECT_THAT(Printed(late), Not(HasSubstr("failed")));
  auto logs = All<LogSite>(late);
  ASSERT_EQ(logs.size(), 1u);
  EXPECT_THAT(logs[0].text, HasSubstr("abandoned attempt r ended"));
  EXPECT_TRUE(Printed(d.Feed(MetricsReported{Metrics("b", kRun, 0, 19)})).empty());
  EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kTraining);
  d.Feed(StageReportedDone{Done("a", "r-1")});
  EXPECT_EQ(ExitCode(d.Feed(StageReportedDone{Done("c", "r-1")})), 0);
}

TEST(RunMachine, ASilentSpareSiteDoesNotInterruptTheAttempt) {
  RunConfig c = Config();
  c.even_split = false;
  c.pinned = {{{"a"}, 2}, {{"b"}, 5}};  // c is a spare
  Driver d(c);
  d.JoinAndProfile({"a", "b", "c"});
  ASSERT_THAT(Sites(Assignments(d.last())), ElementsAre("a", "b"));
  auto out = d.Feed(HeartbeatLost{"c"});
  EXPECT_TRUE(Printed(out).empty());
  EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kTraining);
}

TEST(RunMachine, TheCoordinatorsStoreResumesFromItsNewestStepAndIsPruned) {
  RunConfig c = Config();
  c.job.checkpoint.store = core::CheckpointStore::kCoordinator;
  c.job.checkpoint.keep = 2;
  c.find_checkpoint = [](std::string* skipped) -> absl::StatusOr<core::CheckpointFiles> {
    *skipped = "step-15: incomplete (1 of 3 stages); ";
    // Written by the first plan: a ops 0-1, b ops 2-3, c ops 4-5.
    core::CheckpointFiles f{10,
                            "/runs/t/checkpoints/step-10",
                            {"stage-0.safetensors", "stage-0.json", "stage-1.safetensors", "stage-1.json",
                             "stage-2.safetensors", "stage-2.json"}};
    f.shard_tensors["stage-0.safetensors"] = {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                                              "optim.m.model.embed_tokens.weight"};
    f.shard_tensors["stage-1.safetensors"] = {"model.layers.0.mlp.up_proj.weight",
                                              "model.layers.1.input_layernorm.weight"};
    f.shard_tensors["stage-2.safetensors"] = {"model.layers.1.mlp.down_proj.weight", "lm_head.weight"};
    return f;
  };
  Driver d(c);
  d.JoinAndProfile({"a", "b", "c"});
  auto step = d.Feed(MetricsReported{Metrics("a", kRun, 0, 9)});
  auto pruned = All<PruneCheckpoints>(step);
  ASSERT_EQ(pruned.size(), 1u);
  EXPECT_EQ(pruned[0].newest, 10);
  EXPECT_EQ(pruned[0].keep, 2);

  d.Feed(HeartbeatLost{"c"});
  d.Feed(StageReportedDone{Done("a", kRun, "broke")});
  auto resumed = d.Feed(StageReportedDone{Done("b", kRun, "broke")});
  EXPECT_THAT(Printed(resumed), HasSubstr("checkpoints skipped: step-15: incomplete"));
  EXPECT_THAT(Printed(resumed), HasSubstr("resuming from step 10 of the coordinator's checkpoints"));
  auto removed = All<RemoveCheckpointsAbove>(resumed);
  ASSERT_EQ(removed.size(), 1u);
  EXPECT_EQ(removed[0].step, 10);
  // The new plan: a ops 0-2, b ops 3-5. Each site gets every JSON and only the shards holding its ops.
  auto assigned = Assignments(resumed);
  ASSERT_EQ(assigned.count("a"), 1u);
  EXPECT_EQ(assigned["a"].resume_step(), 10);
  EXPECT_THAT(std::vector<std::string>(assigned["a"].resume_files().begin(), assigned["a"].resume_files().end()),
              ElementsAre("checkpoints/step-10/stage-0.safetensors", "checkpoints/step-10/stage-0.json",
                          "checkpoints/step-10/stage-1.safetensors", "checkpoints/step-10/stage-1.json",
                          "checkpoints/step-10/stage-2.json"));
  EXPECT_THAT(std::vector<std::string>(assigned["b"].resume_files().begin(), assigned["b"].resume_files().end()),
              ElementsAre("checkpoints/step-10/stage-0.json", "checkpoints/step-10/stage-1.safetensors",
                          "checkpoints/step-10/stage-1.json", "checkpoints/step-10/stage-2.safetensors",
                          "checkpoints/step-10/stage-2.json"));
  // The coordinator serves each site those files alone.
  auto begun = All<BeginAttempt>(resumed);
  ASSERT_EQ(begun.size(), 1u);
  EXPECT_EQ(begun[0].store_quota_bytes, StoreQuotaBytes(c));
  EXPECT_GT(StoreQuotaBytes(c), 5 * (int64_t{64} << 20));  // keep 2: four steps' and the weights' headers at least
  // With job.step_overlap a switch's boundary also keeps the early weights: the parameters once more a
  // step (and the weights); not under DiLoCo, whose boundaries keep none.
  double params = 0;
  for (const auto& op : c.graph.ops) params += op.param_bytes;
  ASSERT_GT(params, 0);
  RunConfig overlapped = c;
  overlapped.job.step_overlap = 1;
  EXPECT_EQ(StoreQuotaBytes(overlapped) - StoreQuotaBytes(c), 5 * static_cast<int64_t>(params));
  overlapped.job.sync.mode = core::SyncMode::kDiloco;
  EXPECT_EQ(StoreQuotaBytes(overlapped), StoreQuotaBytes(c));
  EXPECT_EQ(begun[0].readable["b"].count("checkpoints/step-10/stage-0.safetensors"), 0u);
  EXPECT_EQ(begun[0].readable["b"].count("checkpoints/step-10/stage-2.safetensors"), 1u);
  EXPECT_EQ(begun[0].readable["a"].count("checkpoints/step-10/stage-2.safetensors"), 0u);
}

// DiLoCo round states (#17): resuming, each replica of a stage is named its own round state only when
// every replica of the stage wrote one for this very stage (ops and shares); otherwise none is, and the
// run says why.
TEST(RunMachine, DilocoReplicasResumeTheirRoundStatesOnlyWhenAllFitTheStage) {
  for (const bool fits : {true, false}) {
    SCOPED_TRACE(fits ? "the shares the checkpoint was written with" : "other shares");
    RunConfig c = Config();
    c.even_split = false;
    c.plan_path = "pinned.json";
    c.pinned = {{{"a", "b"}, 5, {3, 1}}};
    c.job.sync.mode = core::SyncMode::kDiloco;
    c.job.checkpoint.store = core::CheckpointStore::kCoordinator;
    c.find_checkpoint = [fits](std::string*) -> absl::StatusOr<core::CheckpointFiles> {
      core::CheckpointFiles f{10, "/runs/t/checkpoints/step-10", {"stage-0.safetensors", "stage-0.json"}};
      for (int r = 0; r < 2; ++r) {
        core::ReplicaMeta m;
        m.step = 10;
        m.num_stages = 1;
        m.replica = r;
        m.last_op = 5;
        m.micro_batches = fits ? std::vector<int>{3, 1} : std::vector<int>{2, 2};
        f.round_states[0][r] = m;
      }
      return f;
    };
    Driver d(c);
    d.JoinAndProfile({"a", "b", "c"});
    d.Feed(MetricsReported{Metrics("a", kRun, 0, 11)});
    v1::StageDone poisoned = Done("b", kRun, "stage 0 replica 1 (site 'b'): peer 'c' sent a non-finite gradient");
    poisoned.set_error_code(static_cast<int>(absl::StatusCode::kDataLoss));
    d.Feed(StageReportedDone{poisoned});
    d.Feed(StageReportedDone{Done("a", kRun, "broke")});
    auto resumed = d.Feed(Tick{}, 7);  // heartbeats named nobody: recovery from the checkpoint
    EXPECT_THAT(Printed(resumed), HasSubstr("resuming from step 10 of the coordinator's checkpoints"));
    auto assigned = Assignments(resumed);
    ASSERT_EQ(assigned.size(), 2u) << Printed(resumed);
    auto begun = All<BeginAttempt>(resumed);
    ASSERT_EQ(begun.size(), 1u);
    EXPECT_EQ(begun[0].round_writers["a"], std::make_pair(0, 0));
    EXPECT_EQ(begun[0].round_writers["b"], std::make_pair(0, 1));
    for (const auto& [site, replica] : {std::pair<std::string, std::string>{"a", "0"}, {"b", "1"}}) {
      const std::vector<std::string> files(assigned[site].resume_files().begin(), assigned[site].resume_files().end());
      const std::string own = "checkpoints/step-10/stage-0.replica-" + replica + ".safetensors";
      const std::string other =
          "checkpoints/step-10/stage-0.replica-" + std::string(replica == "0" ? "1" : "0") + ".json";
      EXPECT_EQ(std::count(files.begin(), files.end(), own), fits ? 1 : 0) << site;
      EXPECT_EQ(std::count(files.begin(), files.end(), other), 0) << site;  // never another replica's
      EXPECT_EQ(begun[0].readable[site].count(own), fits ? 1u : 0u) << site;
    }
    EXPECT_THAT(Printed(resumed), HasSubstr(fits ? "stage 0: every DiLoCo replica resumes its own round state"
                                                 : "stage 0: every DiLoCo replica resumes from replica 0's state "
                                                   "(stage 0: replica 0's round state was written for stage 0 of "
                                                   "1, ops 0-5, shares [2, 2]; it resumes as stage 0 of 1, ops "
                                                   "0-5, shares [3, 1]"));
  }
}

// DiLoCo: the progress line says where the round is and what the last outer sync cost; metrics.jsonl has
// each replica's sync and drift.
TEST(RunMachine, DilocoProgressShowsTheRoundAndTheLastOuterSync) {
  RunConfig c = Config();
  c.job.sync.mode = core::SyncMode::kDiloco;
  c.job.sync.inner_steps = 5;
  Driver d(c);
  d.JoinAndProfile({"a", "b", "c"});
  EXPECT_THAT(Printed(d.Feed(MetricsReported{Metrics("a", kRun, 0, 2)})), HasSubstr("inner step 3/5"));
  v1::MetricsReport m = Metrics("a", kRun, 0, 5);
  m.set_outer_sync_step(5);
  m.set_outer_sync_bytes(2500000);
  m.set_outer_sync_seconds(1.25);
  m.set_outer_drift(0.5);
  auto step = d.Feed(MetricsReported{m});
  EXPECT_THAT(Printed(step), HasSubstr("inner step 1/5  last sync after step 5: 2.5 MB, 1.25 s"));
  auto jsonl = All<WriteRunFile>(step);
  ASSERT_EQ(jsonl.size(), 1u);
  const auto stage = nlohmann::json::parse(jsonl[0].content)["stages"][0];
  EXPECT_EQ(stage["outer_sync_step"], 5);
  EXPECT_EQ(stage["outer_sync_bytes"], 2500000);
  EXPECT_DOUBLE_EQ(stage["outer_drift"].get<double>(), 0.5);
}

// Whole DiLoCo pipelines outlive a lost one (#17): pipelines a -> c and b -> d; d is lost after b, its
// pipeline's other stage, failed (its neighbour went): the pipeline (b, d) is left out, b's failure is
// its own, and a and c switch at a step boundary to a plan without d. A failure outside the lost
// pipeline, or a lost site of pipeline 0 (the writers), is recovered from the newest checkpoint as before.
TEST(RunMachine, ALostDilocoPipelineIsLeftOutAndTheOtherGoesOnToASwitch) {
  RunConfig c = Config();
  c.spec.sites.push_back({"d", {"127.0.0.1", 7004}});
  c.even_split = false;
  c.plan_path = "pinned.json";
  c.pinned = {{{"a", "b"}, 2, {2, 2}}, {{"c", "d"}, 5, {2, 2}}};
  c.job.sync.mode = core::SyncMode::kDiloco;
  c.job.sync.inner_steps = 5;
  c.spec.heartbeat_interval_seconds = 0.1;
  c.steps = c.job.steps = 100;
  {
    Driver d(c);
    d.JoinAndProfile({"a", "b", "c", "d"});
    ASSERT_THAT(Sites(Assignments(d.last())), ElementsAre("a", "b", "c", "d"));
    EXPECT_TRUE(Assignments(d.last())["d"].whole_pipelines());
    d.Feed(MetricsReported{Metrics("a", kRun, 0, 10)});
    auto failed = d.Feed(StageReportedDone{Done("b", kRun, "stage 0 replica 1 (site 'b'): peer 'd' stream broke")});
    EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kFailing) << Printed(failed);
    auto lost = d.Feed(HeartbeatLost{"d"});
    auto boundary = All<SetBoundary>(lost);
    ASSERT_EQ(boundary.size(), 1u) << Printed(lost);
    EXPECT_EQ(boundary[0].step, 14);
    EXPECT_EQ(boundary[0].left_out, (std::vector<std::string>{"b", "d"}));
    EXPECT_THAT(Printed(lost),
                HasSubstr("its DiLoCo pipeline ('b', 'd') is left out of the outer average and the others go on"));
    EXPECT_THAT(Printed(lost), HasSubstr("the failure of 'b' was the lost site's pipeline's own"));
    EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kSwitching);
    d.Feed(StageReportedDone{DoneAt("a", kRun, boundary[0].step)});
    auto switched = d.Feed(StageReportedDone{DoneAt("c", kRun, boundary[0].step)});
    EXPECT_THAT(Printed(switched), HasSubstr("switch: every stage saved step 14"));
    auto assigned = Assignments(switched);
    ASSERT_FALSE(assigned.empty()) << Printed(switched);
    EXPECT_EQ(assigned.count("d"), 0u);
    for (const auto& [site, a] : assigned) EXPECT_EQ(a.resume_step(), 14) << site;
  }
  {  // Lost first, its pipeline's stage failing after: that report is of a site the attempt left out.
    Driver d(c);
    d.JoinAndProfile({"a", "b", "c", "d"});
    d.Feed(MetricsReported{Metrics("a", kRun, 0, 10)});
    EXPECT_EQ(All<SetBoundary>(d.Feed(HeartbeatLost{"d"})).size(), 1u);
    d.Feed(StageReportedDone{Done("b", kRun, "peer 'd' stream broke")});
    EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kSwitching);
  }
  {  // A failure in the other pipeline too: not the lost pipeline's own, so the newest checkpoint.
    Driver d(c);
    d.JoinAndProfile({"a", "b", "c", "d"});
    d.Feed(MetricsReported{Metrics("a", kRun, 0, 10)});
    d.Feed(StageReportedDone{Done("b", kRun, "peer 'd' stream broke")});
    d.Feed(StageReportedDone{Done("a", kRun, "peer 'b' broke")});
    auto lost = d.Feed(HeartbeatLost{"d"});
    EXPECT_THAT(Printed(lost), Not(HasSubstr("is left out")));
    EXPECT_NE(d.machine().phase(), RunMachine::Phase::kSwitching);
  }
  {  // c, pipeline 0's last stage (a writer), lost: no leaving out.
    Driver d(c);
    d.JoinAndProfile({"a", "b", "c", "d"});
    d.Feed(MetricsReported{Metrics("a", kRun, 0, 10)});
    auto lost = d.Feed(HeartbeatLost{"c"});
    EXPECT_THAT(Printed(lost), Not(HasSubstr("is left out")));
    EXPECT_TRUE(All<SetBoundary>(lost).empty());
  }
}

// DiLoCo workers of a one-stage plan outlive a lost one (#17): the others are told to leave it out, and
// switch at a step boundary to a plan without it, resuming from exactly that step. A lost replica 0 (the
// stage's writer) is recovered from the newest checkpoint as before, and so is a loss too close to the
// run's end for a switch (its final outer sync needs every worker).
TEST(RunMachine, ALostDilocoWorkerIsLeftOutAndTheOthersGoOnToASwitch) {
  RunConfig c = Config();
  c.even_split = false;
  c.plan_path = "pinned.json";
  c.pinned = {{{"a", "b", "c"}, 5}};
  c.job.sync.mode = core::SyncMode::kDiloco;
  c.job.sync.inner_steps = 5;
  c.spec.heartbeat_interval_seconds = 0.1;  // a switch 3 steps of 0.1 s ahead
  c.steps = c.job.steps = 100;
  {
    Driver d(c);
    d.JoinAndProfile({"a", "b", "c"});
    ASSERT_THAT(Sites(Assignments(d.last())), ElementsAre("a", "b", "c"));
    d.Feed(MetricsReported{Metrics("a", kRun, 0, 10)});
    auto lost = d.Feed(HeartbeatLost{"c"});
    auto boundary = All<SetBoundary>(lost);
    ASSERT_EQ(boundary.size(), 1u) << Printed(lost);
    EXPECT_EQ(boundary[0].step, 14);
    EXPECT_EQ(boundary[0].left_out, std::vector<std::string>{"c"});
    EXPECT_THAT(Printed(lost), HasSubstr("its DiLoCo worker is left out of the outer average and the others go on"));
    EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kSwitching);
    d.Feed(StageReportedDone{DoneAt("a", kRun, boundary[0].step)});
    auto switched = d.Feed(StageReportedDone{DoneAt("b", kRun, boundary[0].step)});  // c never reports
    EXPECT_THAT(Printed(switched), HasSubstr("switch: every stage saved step 14"));
    auto assigned = Assignments(switched);
    ASSERT_FALSE(assigned.empty()) << Printed(switched);
    for (const auto& [site, a] : assigned) {
      EXPECT_NE(site, "c");
      EXPECT_EQ(a.resume_step(), 14) << site;
    }
  }
  {  // Lost before the attempt's first report: the workers left out are told at once, the boundary later.
    Driver d(c);
    d.JoinAndProfile({"a", "b", "c"});
    auto lost = d.Feed(HeartbeatLost{"c"});
    auto told = All<SetBoundary>(lost);
    ASSERT_EQ(told.size(), 1u) << Printed(lost);
    EXPECT_EQ(told[0].step, 0);
    EXPECT_EQ(told[0].left_out, std::vector<std::string>{"c"});
    auto placed = All<SetBoundary>(d.Feed(MetricsReported{Metrics("a", kRun, 0, 0)}));
    ASSERT_EQ(placed.size(), 1u);
    EXPECT_EQ(placed[0].step, 1);
    EXPECT_EQ(placed[0].left_out, std::vector<std::string>{"c"});
  }
  {
    // c's executor restarts: it registers again and is measured as a site joining mid-run; a plan with it
    // (now far faster) is switched to, and it resumes with the others from that switch's checkpoint.
    Driver d(c);
    d.JoinAndProfile({"a", "b", "c"});
    d.Feed(MetricsReported{Metrics("a", kRun, 0, 10)});
    const int64_t first = All<SetBoundary>(d.Feed(HeartbeatLost{"c"}))[0].step;
    d.Feed(StageReportedDone{DoneAt("a", kRun, first)});
    d.Feed(StageReportedDone{DoneAt("b", kRun, first)});
    ASSERT_EQ(d.machine().phase(), RunMachine::Phase::kTraining);
    const std::string attempt = d.machine().job_id();
    d.Feed(MetricsReported{Metrics("a", attempt, 0, static_cast<int>(first) + 2)});
    auto again = d.Feed(SiteRegistered{"c", "127.0.0.1:9c", "cpu"});
    EXPECT_THAT(All<LogSite>(again).back().text, HasSubstr("registered again after it was lost"));
    d.Feed(HeartbeatBack{"c"});
    auto asked = d.Feed(Tick{}, 1.0);
    auto commands = All<SendCommand>(asked);
    ASSERT_EQ(commands.size(), 1u) << Printed(asked);
    EXPECT_EQ(commands[0].site, "c");
    ASSERT_TRUE(commands[0].command.has_profile());
    auto measured = d.Feed(ProfileReported{ProfileAmong("c", {"a", "b"}, 1e13)});
    auto boundary = All<SetBoundary>(measured);
    ASSERT_EQ(boundary.size(), 1u) << Printed(measured);
    EXPECT_TRUE(boundary[0].left_out.empty());
    d.Feed(StageReportedDone{DoneAt("a", attempt, boundary[0].step)});
    auto switched = d.Feed(StageReportedDone{DoneAt("b", attempt, boundary[0].step)});
    auto assigned = Assignments(switched);
    ASSERT_TRUE(assigned.count("c")) << Printed(switched);
    EXPECT_EQ(assigned["c"].resume_step(), boundary[0].step);
  }
  {
    Driver d(c);
    d.JoinAndProfile({"a", "b", "c"});
    d.Feed(MetricsReported{Metrics("a", kRun, 0, 10)});
    auto lost = d.Feed(HeartbeatLost{"a"});  // replica 0
    EXPECT_TRUE(All<SetBoundary>(lost).empty()) << Printed(lost);
    EXPECT_THAT(Printed(lost), HasSubstr("lost: site 'a' stopped answering"));
    EXPECT_NE(d.machine().phase(), RunMachine::Phase::kSwitching);
  }
  {
    // The survivors never reach the boundary: the switch times out, and the left-out site counts as lost
    // for the recovery from the newest checkpoint (the run does not end).
    Driver d(c);
    d.JoinAndProfile({"a", "b", "c"});
    d.Feed(MetricsReported{Metrics("a", kRun, 0, 10)});
    ASSERT_EQ(All<SetBoundary>(d.Feed(HeartbeatLost{"c"})).size(), 1u);
    auto timed_out = d.Feed(Tick{}, 600);
    EXPECT_THAT(Printed(timed_out), HasSubstr("did not all end at step"));
    EXPECT_EQ(ExitCode(timed_out), std::nullopt) << Printed(timed_out);
    EXPECT_THAT(Printed(timed_out), HasSubstr("lost: site 'c' stopped answering"));
  }
  {
    // on_failure: wait waits for a lost site; it is not left out.
    RunConfig w = c;
    w.spec.on_failure = core::OnFailure::kWait;
    Driver d(w);
    d.JoinAndProfile({"a", "b", "c"});
    d.Feed(MetricsReported{Metrics("a", kRun, 0, 10)});
    EXPECT_TRUE(All<SetBoundary>(d.Feed(HeartbeatLost{"c"})).empty());
  }
  {
    Driver d(c);
    d.JoinAndProfile({"a", "b", "c"});
    d.Feed(MetricsReported{Metrics("a", kRun, 0, 97)});
    auto lost = d.Feed(HeartbeatLost{"b"});  // a switch would come after the run's last step
    EXPECT_TRUE(All<SetBoundary>(lost).empty()) << Printed(lost);
    EXPECT_NE(d.machine().phase(), RunMachine::Phase::kSwitching);
  }
}

// DiLoCo (#17, #21): a switch's deadline covers the replicas' synchronisation at its step boundary
// (StageWorker::SynchroniseAtBoundary: the exchange in flight, then every fragment), priced as the planner
// prices an exchange: over links of 100 bytes/s one takes minutes, and the drained switch waits for it;
// the same switch without DiLoCo times out after the drain time.
TEST(RunMachine, ADilocoSwitchWaitsForTheReplicasSynchronisationAtItsBoundary) {
  for (const bool diloco : {true, false}) {
    SCOPED_TRACE(diloco ? "diloco" : "every step");
    RunConfig c = Config();
    c.even_split = false;
    c.plan_path = "pinned.json";
    c.pinned = {{{"a", "b", "c"}, 5}};
    if (diloco) {
      c.job.sync.mode = core::SyncMode::kDiloco;
      c.job.sync.inner_steps = 5;
    }
    c.spec.heartbeat_interval_seconds = 0.1;
    c.steps = c.job.steps = 100;
    Driver d(c);
    d.link_bandwidth = 100;
    d.JoinAndProfile({"a", "b", "c"});
    ASSERT_THAT(Sites(Assignments(d.last())), ElementsAre("a", "b", "c"));
    d.Feed(MetricsReported{Metrics("a", kRun, 0, 10)});
    ASSERT_EQ(All<SetBoundary>(d.Feed(SiteLeaving{"c", "meridian drain"})).size(), 1u);
    partitioner::ClusterProfile links;  // as the driver answered the probes
    for (const std::string a : {"a", "b", "c"})
      for (const std::string b : {"a", "b", "c"})
        if (a != b) links.links.push_back({a, b, d.link_bandwidth, d.link_latency});
    partitioner::StagePlan stage;
    stage.site_names = {"a", "b", "c"};
    stage.last_op = 5;
    const double exchange =
        partitioner::ExchangeSeconds(SmallGraph(), links, partitioner::SyncModelOf(c.job.sync), stage);
    ASSERT_GT(exchange, 100);
    auto waited = d.Feed(Tick{}, c.drain_seconds + 60);
    if (!diloco) {
      EXPECT_THAT(Printed(waited), HasSubstr("did not all end at step"));
      continue;
    }
    EXPECT_THAT(Printed(waited), Not(HasSubstr("did not all end at step")));
    EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kSwitching);
    EXPECT_THAT(Printed(d.Feed(Tick{}, 2 * exchange)), HasSubstr("did not all end at step"));
  }
}

// A compromised site: progress it could forge is not believed.
TEST(RunMachine, MetricsThatDoNotFitThePlanOrTheStepsBeforeAreIgnored) {
  Driver d(Config());
  d.JoinAndProfile({"a", "b", "c"});
  EXPECT_THAT(Printed(d.Feed(MetricsReported{Metrics("a", kRun, 0, 0)})), HasSubstr("step 1/20"));
  // b runs stage 1 but claims stage 0 (whose reports are the progress), with a later step.
  auto forged = d.Feed(MetricsReported{Metrics("b", kRun, 0, 18)});
  EXPECT_TRUE(Printed(forged).empty());
  ASSERT_EQ(All<LogSite>(forged).size(), 1u);
  EXPECT_THAT(All<LogSite>(forged)[0].text, HasSubstr("does not fit the plan"));
  // A step again, or out of range, or without the attempt's job id.
  EXPECT_TRUE(Printed(d.Feed(MetricsReported{Metrics("a", kRun, 0, 0)})).empty());
  EXPECT_TRUE(Printed(d.Feed(MetricsReported{Metrics("a", kRun, 0, 20)})).empty());
  EXPECT_TRUE(Printed(d.Feed(MetricsReported{Metrics("a", "", 0, 5)})).empty());
  EXPECT_THAT(Printed(d.Feed(MetricsReported{Metrics("a", kRun, 0, 1)})), HasSubstr("step 2/20"));
}

// A site whose measurements do not check out is planned without; the others go on.
TEST(RunMachine, AProfileThatDoesNotCheckOutLeavesItsSiteOutOfThePlan) {
  for (auto forge : std::vector<std::function<void(v1::ProfileReport*)>>{
           [](v1::ProfileReport* r) { r->set_links_json("{\"from\": 1}"); },  // not an array
           [](v1::ProfileReport* r) {  // a link between two other sites, claimed fast to steer the plan
             r->set_links_json(
                 R"([{"from": "a", "to": "c", "bandwidth_bytes_per_second": 1e12, "latency_seconds": 0}])");
           },
           [](v1::ProfileReport* r) {  // another site's device
             r->set_site_profile_json(R"({"name": "a", "flops_per_second": 1e15, "memory_bytes": 1e12})");
           },
           [](v1::ProfileReport* r) {  // an op the model does not have
             r->set_site_profile_json(
                 R"({"name": "b", "flops_per_second": 1e11, "memory_bytes": 8e9, "op_seconds": {"evil": 0.1}})");
           },
           [](v1::ProfileReport* r) {  // more workers than the spec's devices, to draw more of the model
             r->set_site_profile_json(R"({"name": "b", "flops_per_second": 1e11, "memory_bytes": 8e9, "workers": 8,
                                          "intra_site_bytes_per_second": 1e12})");
           },
           [](v1::ProfileReport* r) {  // a negative transport cost, to pull work onto itself
             r->set_site_profile_json(
                 R"({"name": "b", "flops_per_second": 1e11, "memory_bytes": 8e9, "transport_seconds_per_frame": -1})");
           },
           [](v1::ProfileReport* r) { r->set_site_profile_json("{"); }}) {
    Driver d(Config());
    d.Feed(RunStarted{});
    for (const char* s : {"a", "b", "c"}) d.Feed(SiteRegistered{s, "x", "cpu"});
    d.Feed(ProfileReported{Profile("a")});
    v1::ProfileReport bad = Profile("b");
    forge(&bad);
    auto refused = d.Feed(ProfileReported{bad});
    EXPECT_THAT(Printed(refused), HasSubstr("site 'b' sent a profile that does not check out"));
    EXPECT_THAT(Printed(refused), HasSubstr("planning without it"));
    EXPECT_FALSE(ExitCode(refused));
    auto planned = d.Feed(ProfileReported{Profile("c")});
    EXPECT_FALSE(ExitCode(planned)) << Printed(planned);
    auto assigned = Assignments(planned);
    EXPECT_THAT(Sites(assigned), ElementsAre("a", "c"));
  }
}

// No site takes part in two link probes at once (a site's uplink is shared: two at once each read about
// half its rate): the probes go in rounds of disjoint pairs, every pair once, the site whose name sorts
// first probing both directions; the next round starts when the last one's sites have all answered.
TEST(RunMachine, LinksAreProbedInRoundsOfDisjointPairs) {
  for (const std::vector<std::string>& names :
       {std::vector<std::string>{"a", "b", "c", "d"}, std::vector<std::string>{"e", "d", "c", "b", "a"}}) {
    SCOPED_TRACE(names.size() == 4 ? "4 sites" : "5 sites, given in reverse order");
    RunConfig c = Config();
    c.spec.sites.clear();
    for (size_t i = 0; i < names.size(); ++i)
      c.spec.sites.push_back({names[i], {"127.0.0.1", static_cast<int>(7001 + i)}});
    Driver d(c);
    d.answer_link_probes = false;
    d.Feed(RunStarted{});
    for (const auto& s : names) d.Feed(SiteRegistered{s, "127.0.0.1:9" + s, "cpu"});
    std::vector<SendCommand> round;
    for (const auto& s : names) round = Profiles(d.Feed(ProfileReported{Profile(s)}));
    std::set<std::pair<std::string, std::string>> pairs;
    int rounds = 0;
    std::vector<Action> last;
    while (!round.empty()) {
      ++rounds;
      std::set<std::string> busy;  // the sites of this round's probes
      for (const auto& cmd : round) {
        ASSERT_TRUE(cmd.command.profile().links_only());
        ASSERT_EQ(cmd.command.profile().peers_size(), 1);
        const std::string& peer = cmd.command.profile().peers(0).site();
        EXPECT_LT(cmd.site, peer);
        EXPECT_TRUE(busy.insert(cmd.site).second) << cmd.site << " twice in round " << rounds;
        EXPECT_TRUE(busy.insert(peer).second) << peer << " twice in round " << rounds;
        EXPECT_TRUE(pairs.insert({cmd.site, peer}).second) << cmd.site << "-" << peer << " probed again";
      }
      std::vector<SendCommand> next;
      for (size_t i = 0; i < round.size(); ++i) {
        last = d.Feed(ProfileReported{Links(round[i].site, {round[i].command.profile().peers(0).site()})});
        std::vector<SendCommand> sent;  // the next round's probes (after the last round, the assignments)
        for (auto& cmd : All<SendCommand>(last))
          if (cmd.command.has_profile()) sent.push_back(std::move(cmd));
        if (i + 1 < round.size()) {
          EXPECT_TRUE(sent.empty()) << "a round starts before the last one ended";
        }
        next = sent;
      }
      round = next;
    }
    const size_t n = names.size();
    EXPECT_EQ(pairs.size(), n * (n - 1) / 2);
    EXPECT_EQ(rounds, static_cast<int>(n % 2 ? n : n - 1));
    EXPECT_THAT(Printed(last), HasSubstr("predicted step time"));
  }
}

// A link's receive cost, where the probing site measured it, is kept in profile.json with the link it
// was measured on: the planner prices frames received over that link with it.
TEST(RunMachine, ALinksMeasuredReceiveCostGoesIntoTheProfile) {
  Driver d(Config());
  d.answer_link_probes = false;
  d.Feed(RunStarted{});
  for (const char* s : {"a", "b", "c"}) d.Feed(SiteRegistered{s, "x", "cpu"});
  std::vector<SendCommand> round;
  for (const char* s : {"a", "b", "c"}) round = Profiles(d.Feed(ProfileReported{Profile(s)}));
  std::vector<Action> last, all;
  while (!round.empty()) {
    std::vector<SendCommand> next;
    for (const auto& cmd : round) {
      // Each link into the probing site costs it 2.5e-8 s a byte; the other direction is not measured.
      v1::ProfileReport r = Links(cmd.site, {cmd.command.profile().peers(0).site()});
      auto links = nlohmann::json::parse(r.links_json());
      for (auto& l : links)
        if (l["to"] == cmd.site) l["receive_seconds_per_byte"] = 2.5e-8;
      r.set_links_json(links.dump());
      last = d.Feed(ProfileReported{r});
      all.insert(all.end(), last.begin(), last.end());
      for (auto& sent : All<SendCommand>(last))
        if (sent.command.has_profile()) next.push_back(std::move(sent));
    }
    round = next;
  }
  ASSERT_EQ(d.machine().phase(), RunMachine::Phase::kTraining) << Printed(last);
  int measured = 0, links = 0;
  for (const auto& f : All<WriteRunFile>(all)) {
    if (f.name != core::kProfileFile) continue;
    const auto profile = nlohmann::json::parse(f.content);  // kept: the loop below reads into it
    for (const auto& l : profile["links"]) {
      ++links;
      if (l.contains("receive_seconds_per_byte")) {
        ++measured;
        EXPECT_EQ(l["receive_seconds_per_byte"].get<double>(), 2.5e-8);
      }
    }
  }
  EXPECT_EQ(links, 6);
  EXPECT_EQ(measured, 3);  // a pair's prober measures the direction into itself
}

// The second round's answers are checked as strictly: a site asked to probe some links reports those
// and nothing else, or is planned without.
TEST(RunMachine, ALinksAnswerThatDoesNotCheckOutLeavesItsSiteOutOfThePlan) {
  for (auto forge : std::vector<std::function<void(v1::ProfileReport*)>>{
           [](v1::ProfileReport* r) { r->set_links_json("{\"from\": 1}"); },  // not an array
           [](v1::ProfileReport* r) {  // a link it was not asked to probe (b probes c only), claimed fast
             *r = Links("b", {"a", "c"}, 1e12, 0);
           },
           [](v1::ProfileReport* r) {  // a link between two other sites
             r->set_links_json(
                 R"([{"from": "a", "to": "c", "bandwidth_bytes_per_second": 1e12, "latency_seconds": 0}])");
           },
           [](v1::ProfileReport* r) { *r = Links("b", {"c"}, -1, 0.001); },  // a negative bandwidth
           [](v1::ProfileReport* r) {  // one direction only: the pair could not be planned
             r->set_links_json(
                 R"([{"from": "b", "to": "c", "bandwidth_bytes_per_second": 1e8, "latency_seconds": 0.001}])");
           },
           [](v1::ProfileReport* r) {
             *r = Links("b", {"c", "c"});
           },                                                  // each link twice, with figures to pick from
           [](v1::ProfileReport* r) { *r = Links("b", {}); },  // none of them
           [](v1::ProfileReport* r) {  // a receive cost beyond the bound, to price a link out of the plan
             r->set_links_json(R"([{"from": "b", "to": "c", "bandwidth_bytes_per_second": 1e8, "latency_seconds": 0.001,
                                    "receive_seconds_per_byte": 1},
                                   {"from": "c", "to": "b", "bandwidth_bytes_per_second": 1e8, "latency_seconds": 0.001}])");
           },
           [](v1::ProfileReport* r) {  // a receive cost that is not a number
             r->set_links_json(
                 R"([{"from": "b", "to": "c", "bandwidth_bytes_per_second": 1e8, "latency_seconds": 0.001},
                                   {"from": "c", "to": "b", "bandwidth_bytes_per_second": 1e8, "latency_seconds": 0.001,
                                    "receive_seconds_per_byte": "slow"}])");
           },
           [](v1::ProfileReport* r) {  // its device again, faster than measured, where only links were asked for
             r->set_site_profile_json(R"({"name": "b", "flops_per_second": 1e15, "memory_bytes": 1e12})");
           }}) {
    Driver d(Config());
    d.answer_link_probes = false;
    d.Feed(RunStarted{});
    for (const char* s : {"a", "b", "c"}) d.Feed(SiteRegistered{s, "x", "cpu"});
    for (const char* s : {"a", "b", "c"}) d.Feed(ProfileReported{Profile(s)});
    v1::ProfileReport bad = Links("b", {"c"});
    forge(&bad);
    auto refused = d.Feed(ProfileReported{bad});
    EXPECT_THAT(Printed(refused), HasSubstr("site 'b' sent links that do not check out"));
    EXPECT_THAT(Printed(refused), HasSubstr("planning without it"));
    EXPECT_FALSE(ExitCode(refused));
    EXPECT_TRUE(All<SendCommand>(d.Feed(ProfileReported{Links("b", {"c"})})).empty());  // once is enough
    auto planned = d.Feed(ProfileReported{Links("a", {"c"})});  // the next round's (a-b's is left out with b)
    EXPECT_FALSE(ExitCode(planned)) << Printed(planned);
    EXPECT_THAT(Sites(Assignments(planned)), ElementsAre("a", "c"));
  }
  {  // a site's executor that registers again (restarted) before it answered is asked again, once per round
    Driver d(Config());
    d.answer_link_probes = false;
    d.Feed(RunStarted{});
    for (const char* s : {"a", "b", "c"}) d.Feed(SiteRegistered{s, "x", "cpu"});
    d.Feed(ProfileReported{Profile("a")});
    auto again = All<SendCommand>(d.Feed(SiteRegistered{"b", "y", "cpu"}));
    ASSERT_EQ(again.size(), 1u);
    EXPECT_EQ(again[0].site, "b");
    EXPECT_FALSE(again[0].command.profile().links_only());
    EXPECT_TRUE(All<SendCommand>(d.Feed(SiteRegistered{"a", "x", "cpu"})).empty());  // a has answered
    d.Feed(ProfileReported{Profile("b")});
    EXPECT_EQ(Profiles(d.Feed(ProfileReported{Profile("c")})).size(), 1u);  // the links: b probes c
    again = All<SendCommand>(d.Feed(SiteRegistered{"b", "y", "cpu"}));
    ASSERT_EQ(again.size(), 1u);
    EXPECT_TRUE(again[0].command.profile().links_only());
    ASSERT_EQ(again[0].command.profile().peers_size(), 1);
    EXPECT_EQ(again[0].command.profile().peers(0).site(), "c");
    EXPECT_TRUE(All<SendCommand>(d.Feed(SiteRegistered{"c", "x", "cpu"})).empty());      // c probes nobody
    EXPECT_TRUE(All<SendCommand>(d.Feed(SiteRegistered{"a", "x", "cpu"})).empty());      // nor a, in this round
    EXPECT_EQ(All<SendCommand>(d.Feed(ProfileReported{Links("b", {"c"})})).size(), 1u);  // a probes c
    EXPECT_EQ(All<SendCommand>(d.Feed(ProfileReported{Links("a", {"c"})})).size(), 1u);  // a probes b
    EXPECT_FALSE(Assignments(d.Feed(ProfileReported{Links("a", {"b"})})).empty());
  }
  {  // an error while probing fails the run, naming the site
    Driver d(Config());
    d.answer_link_probes = false;
    d.Feed(RunStarted{});
    for (const char* s : {"a", "b", "c"}) d.Feed(SiteRegistered{s, "x", "cpu"});
    for (const char* s : {"a", "b", "c"}) d.Feed(ProfileReported{Profile(s)});
    v1::ProfileReport failed = Links("b", {});
    failed.set_error("probing the link to 'c': connection refused");
    auto out = d.Feed(ProfileReported{failed});
    EXPECT_EQ(ExitCode(out), 1);
    EXPECT_THAT(Printed(out),
                HasSubstr("site 'b' could not measure its links: probing the link to 'c': connection refused"));
  }
}

// A neighbour's NaN (or any corrupt data) fails a stage with DataLoss: every stage resumes from the newest
// checkpoint with the same sites, at most twice in a row; a third time ends the run.
TEST(RunMachine, NonFiniteDataResumesFromTheCheckpointAtMostTwiceInARow) {
  Driver d(Config());
  d.JoinAndProfile({"a", "b", "c"});
  auto poisoned = [&](const std::string& job) {
    v1::StageDone done = Done("b", job, "stage 1 (site 'b'): peer 'a' sent a non-finite gradient norm or loss");
    done.set_error_code(static_cast<int>(absl::StatusCode::kDataLoss));
    d.Feed(StageReportedDone{done});
    d.Feed(StageReportedDone{Done("a", job, "broke")});
    d.Feed(StageReportedDone{Done("c", job, "broke")});
    return d.Feed(Tick{}, 7);  // heartbeats named nobody
  };
  auto first = poisoned(kRun);
  EXPECT_THAT(Printed(first), HasSubstr("recovery: site 'b' failed on corrupt or non-finite data"));
  EXPECT_THAT(Printed(first), HasSubstr("(1 of at most 2 such recoveries)"));
  auto assigned = Assignments(first);
  EXPECT_THAT(Sites(assigned), ElementsAre("a", "b", "c"));
  EXPECT_EQ(assigned["b"].resume_step(), -1);
  EXPECT_EQ(assigned["b"].job_id(), "r-1");
  EXPECT_THAT(Printed(poisoned("r-1")), HasSubstr("(2 of at most 2 such recoveries)"));
  auto last = poisoned("r-2");
  EXPECT_EQ(ExitCode(last), 1);
  EXPECT_THAT(Printed(last),
              HasSubstr("meridian run: site 'b' failed: stage 1 (site 'b'): peer 'a' sent a non-finite"));
}

// What a site sends reaches the operator's terminal without its control characters.
TEST(RunMachine, ASitesTextReachesTheTerminalWithoutControlCharacters) {
  Driver d(Config());
  d.JoinAndProfile({"a", "b", "c"});
  auto out = d.Feed(StageReportedDone{Done("b", kRun, "oops\x1b[2J\rstage 0 finished\n")});
  EXPECT_THAT(Printed(out), HasSubstr("failed: oops\\x1b[2J\\x0dstage 0 finished\\x0a\n"));
  EXPECT_EQ(Printed(out).find('\x1b'), std::string::npos);
}

// Found in review: timeouts fire even under a stream of events; a site's silence before a phase begins
// still counts; a bad profile does not get the honest sites' links refused; a site outside the plan
// cannot end the attempt.
TEST(RunMachine, DeadlinesFireWhateverTheEventsAndOnlyThePlansSitesCount) {
  RunConfig c = Config();
  c.join_timeout_seconds = 5;
  {
    Driver d(c);
    d.Feed(RunStarted{});
    std::optional<int> code;
    for (int i = 0; i < 100 && !code; ++i) code = ExitCode(d.Feed(SiteRegistered{"a", "x", "cpu"}, 0.1));
    EXPECT_EQ(code, 1);  // 10 s of registrations every 0.1 s: the 5 s join timeout still fired
  }
  {
    Driver d(Config());
    d.Feed(RunStarted{});
    d.Feed(SiteRegistered{"c", "x", "cpu"});
    d.Feed(HeartbeatLost{"c"});  // crashed before the others joined
    d.Feed(SiteRegistered{"a", "x", "cpu"});
    auto joined = d.Feed(SiteRegistered{"b", "x", "cpu"});
    EXPECT_THAT(Printed(joined), HasSubstr("2 sites joined"));  // c is not waited for
    v1::ProfileReport bad = Profile("b");
    bad.set_site_profile_json("{");
    d.Feed(ProfileReported{bad});                          // b is dropped first ...
    auto planned = d.Feed(ProfileReported{Profile("a")});  // ... so a has no link to measure (c was never asked)
    EXPECT_FALSE(ExitCode(planned)) << Printed(planned);
    for (const auto& cmd : All<SendCommand>(planned)) EXPECT_FALSE(cmd.command.profile().links_only());
    EXPECT_THAT(Sites(Assignments(planned)), ElementsAre("a"));
    // A site outside the plan reports the end of a stage of the attempt: nothing happens.
    auto spare = d.Feed(StageReportedDone{Done("c", kRun, "boom")});
    EXPECT_FALSE(ExitCode(spare));
    EXPECT_EQ(d.machine().phase(), RunMachine::Phase::kTraining);
  }
}

// Two sites a and b of the same speed (c, too slow to use, unused) run a two-stage pipeline of LargeGraph
// for `steps` steps, the machine's plans followed through its switches. What a stage computes in a step is
// its ops at the site's speed times truth(site, its stage's last op, step); each stage reports that, and
// stage 0 a step of 1.2x the slowest stage. Returns the straggler events and the number of switches.
struct SimulatedRun {
  std::vector<RecordEvent> stragglers;
  int switches = 0;
  double first_prediction = 0;
  std::vector<std::string> layouts;   // the first plan's sites in stage order ("a b"), then each switch's
  std::vector<int64_t> switch_steps;  // each switch's boundary: the steps done when its new plan began
  std::vector<RecordEvent> checks;    // the switch checks' events
  std::string log;                    // each straggler and switch check event and each switch's new layout
};
SimulatedRun RunTwoSitePipeline(Driver* d, const RunConfig& c, int steps,
                                const std::function<double(const std::string&, int, int)>& truth) {
  SimulatedRun run;
  d->Feed(RunStarted{});
  for (const char* s : {"a", "b", "c"}) d->Feed(SiteRegistered{s, std::string("127.0.0.1:9") + s, "cpu"});
  d->link_bandwidth = 1e9;
  d->link_latency = 1e-4;
  const std::map<std::string, double> flops = {{"a", 1e11}, {"b", 1e11}, {"c", 1e9}};
  for (const char* s : {"a", "b", "c"}) d->Feed(ProfileReported{ProfileAmong(s, {}, flops.at(s))});
  EXPECT_EQ(d->machine().phase(), RunMachine::Phase::kTraining);
  if (!d->machine().plan()) return run;
  EXPECT_EQ(d->machine().plan()->stages.size(), 2u);
  run.first_prediction = d->machine().plan()->predicted_step_seconds;
  auto layout = [&] {
    std::string out;
    for (const auto& st : d->machine().plan()->stages) absl::StrAppend(&out, out.empty() ? "" : " ", st.site_names[0]);
    return out;
  };
  run.layouts.push_back(layout());
  int64_t boundary = -1;
  auto feed = [&](auto what) {
    for (const auto& a : d->Feed(what)) {
      if (const auto* e = std::get_if<RecordEvent>(&a); e && (e->kind == "straggler" || e->kind == "switch_check")) {
        (e->kind == "straggler" ? run.stragglers : run.checks).push_back(*e);
        absl::StrAppend(&run.log, e->kind, ": ", e->text, "\n");
      }
      if (const auto* b = std::get_if<SetBoundary>(&a)) boundary = b->step;
    }
  };
  for (int step = 0; step < steps; ++step) {
    const partitioner::Plan plan = *d->machine().plan();
    const std::string job = d->machine().job_id();
    std::vector<double> computes;
    for (const auto& st : plan.stages) {
      partitioner::SiteProfile p{st.site_names[0], flops.at(st.site_names[0]), 8e9, {}, {}};
      computes.push_back(partitioner::RangeSeconds(c.graph, p, st.first_op, st.last_op) * st.micro_batches[0] *
                         truth(st.site_names[0], st.last_op, step));
    }
    const double step_seconds = 1.2 * *std::max_element(computes.begin(), computes.end());
    for (size_t k = plan.stages.size(); k-- > 0;) {  // stage 0, the reporter, last
      v1::MetricsReport m = Metrics(plan.stages[k].site_names[0], job, static_cast<int>(k), step);
      m.set_compute_seconds(computes[k]);
      m.set_step_seconds(step_seconds);
      feed(MetricsReported{m});
    }
    if (d->machine().phase() == RunMachine::Phase::kSwitching && boundary > 0 && step + 1 >= boundary) {
      for (const auto& st : plan.stages) feed(StageReportedDone{DoneAt(st.site_names[0], job, boundary)});
      EXPECT_EQ(d->machine().phase(), RunMachine::Phase::kTraining) << Printed(d->last());
      if (d->machine().phase() != RunMachine::Phase::kTraining) return run;
      run.switch_steps.push_back(boundary);
      boundary = -1;
      ++run.switches;
      run.layouts.push_back(layout());
      for (const auto& st : d->machine().plan()->stages)
        absl::StrAppend(&run.log, st.site_names[0], " ops ", st.first_op, "-", st.last_op, "; ");
      absl::StrAppend(&run.log, "from step ", step + 1, "\n");
    }
  }
  EXPECT_EQ(d->machine().phase(), RunMachine::Phase::kTraining);
  return run;
}

// A plan's last stage computes 1.25x what its ops' profile says on whichever site runs it (ops costing
// more than profiled, or a disturbance that follows them). The site holding it is flagged, its whole
// profile scaled, and the next plan hands the last stage to the other site, which is off in turn: with
// neither the switch check nor the measured layouts the two traded places at every window, 16 switches
// in 300 steps, their figures inflating by 1.56x each time. The new plan is checked before its sites are
// judged: the check finds it slower and takes the run back to its first layout, no switch onto the two
// sites is taken again, and nothing moves after that.
TEST(RunMachine, OpsCostlierThanProfiledWhereverTheyRunDoNotMakeTwoSitesTradePlaces) {
  RunConfig c = StragglerConfig(300);
  c.job.replication = false;       // a pipeline of two stages
  c.spec.elastic.min_gain = 0.05;  // the first re-plan's predicted gain (6%) is taken
  const int last_op = static_cast<int>(c.graph.ops.size()) - 1;
  Driver d(c);
  const SimulatedRun run = RunTwoSitePipeline(
      &d, c, 300, [&](const std::string&, int stage_last_op, int) { return stage_last_op == last_op ? 1.25 : 1.0; });
  // The straggler's switch; the switch check finds the new layout slower and switches back before any of
  // its sites is judged, and no switch onto the two sites is taken again.
  EXPECT_EQ(run.switches, 2) << run.log;
  ASSERT_EQ(run.layouts.size(), 3u);
  EXPECT_NE(run.layouts[1], run.layouts[0]);
  EXPECT_EQ(run.layouts[2], run.layouts[0]);
  EXPECT_EQ(run.stragglers.size(), 1u) << run.log;  // one flag: the second site is not judged before the check
  ASSERT_EQ(run.checks.size(), 1u) << run.log;
  EXPECT_THAT(
      run.checks[0].text,
      ContainsRegex("the switch to (a -> b|b -> a) ran a median [0-9.]+ s a step over its steps [0-9]+-[0-9]+ "
                    "\\(predicted [0-9.]+ s\\) against [0-9.]+ s for (a -> b|b -> a) before it: the plan before "
                    "was [0-9]+% faster, above elastic.min_gain \\(5%\\); switching back"))
      << run.log;
  // The figures stopped inflating: the plan predicts about what it did at the start (16 switches in,
  // without the measured layouts, it predicted 20 times as long).
  EXPECT_LT(d.machine().plan()->predicted_step_seconds, 1.6 * run.first_prediction);
}

// The same with the first stage's ops costing 1.7x their profile (its site reports the step). With
// neither the check nor the measured layouts: 7 switches in 300 steps, the plan predicting 30 times its
// first step; now the switch check reverses the first switch before a second flag, and the figures stop
// at the first flag's scaling.
TEST(RunMachine, OpsCostlierThanProfiledOnTheFirstStageDoNotMakeTwoSitesTradePlaces) {
  RunConfig c = StragglerConfig(300);
  c.job.replication = false;
  c.spec.elastic.min_gain = 0.05;
  const int last_op = static_cast<int>(c.graph.ops.size()) - 1;
  Driver d(c);
  const SimulatedRun run = RunTwoSitePipeline(
      &d, c, 300, [&](const std::string&, int stage_last_op, int) { return stage_last_op == last_op ? 1.0 : 1.7; });
  EXPECT_EQ(run.switches, 2) << run.log;
  EXPECT_EQ(run.layouts.back(), run.layouts.front()) << run.log;
  EXPECT_EQ(run.stragglers.size(), 1u) << run.log;
  ASSERT_EQ(run.checks.size(), 1u) << run.log;
  EXPECT_THAT(run.checks[0].text, HasSubstr("switching back")) << run.log;
  EXPECT_LT(d.machine().plan()->predicted_step_seconds, 2 * run.first_prediction) << run.log;
}

// A switch the check kept, then a flag that would take the run back to a layout that measured slow. Site b
// computes the last stage's ops 1.4x their profile and everything else as profiled (ops its device runs
// slowly); a computes all as profiled. b is flagged, its whole profile scaled, and the run switches to
// b -> a, which the check finds faster and keeps. There b runs its ops at full speed against its scaled
// figures, so a looks slow beside it and is flagged in turn, and a new plan prices a -> b 11% faster.
// That layout ran earlier at about its price, which at a's new figures makes it 24% slower than the
// current plan measures: refused, and nothing moves after that.
TEST(RunMachine, AFlagThatWouldReturnToALayoutThatMeasuredSlowIsRefused) {
  RunConfig c = StragglerConfig(300);
  c.job.replication = false;
  const int last_op = static_cast<int>(c.graph.ops.size()) - 1;
  Driver d(c);
  const SimulatedRun run = RunTwoSitePipeline(&d, c, 300, [&](const std::string& site, int stage_last_op, int) {
    return site == "b" && stage_last_op == last_op ? 1.4 : 1.0;
  });
  EXPECT_EQ(run.switches, 1) << run.log;
  ASSERT_EQ(run.layouts.size(), 2u);
  EXPECT_EQ(run.layouts[0], "a b");
  EXPECT_EQ(run.layouts[1], "b a");
  ASSERT_EQ(run.checks.size(), 1u) << run.log;
  EXPECT_THAT(run.checks[0].text, ContainsRegex("against [0-9.]+ s for a -> b before it: [0-9]+% faster$")) << run.log;
  ASSERT_EQ(run.stragglers.size(), 2u) << run.log;
  EXPECT_EQ(run.stragglers[1].site, "a");
  EXPECT_THAT(
      run.stragglers[1].text,
      ContainsRegex("but a -> b ran a median [0-9.]+ s a step over its last 5 steps to step [0-9]+ earlier in "
                    "this run, [0-9.]+x its price then \\([0-9.]+ s\\): at that, the new plan's [0-9.]+ s "
                    "would run [0-9.]+ s, against [0-9.]+ s for the current plan over its last 5 steps: [0-9]+% "
                    "slower, not above elastic.min_gain \\(10%\\): no switch"))
      << run.log;
}

// A layout left because a site slowed down measured slow: once the slowdown eases, a switch back onto it
// is priced with the site's figures as re-measured then, and goes ahead. Site b slows to 3x from step 5
// to step 40; the run moves work off it, and back once it is flagged faster.
TEST(RunMachine, ALayoutLeftDuringASlowdownIsTakenAgainOnceItEases) {
  RunConfig c = StragglerConfig(120);
  c.job.replication = false;
  Driver d(c);
  const SimulatedRun run = RunTwoSitePipeline(&d, c, 120, [](const std::string& site, int, int step) {
    return site == "b" && step >= 5 && step < 40 ? 3.0 : 1.0;
  });
  ASSERT_GE(run.stragglers.size(), 2u) << run.log;
  for (const auto& e : run.stragglers) EXPECT_EQ(e.site, "b") << run.log;
  EXPECT_THAT(run.stragglers[0].text, HasSubstr("computed 3.00x its planned time"));
  EXPECT_THAT(run.stragglers.back().text, HasSubstr("site 'b' computed 0.33x its planned time"));
  EXPECT_THAT(run.stragglers.back().text, Not(HasSubstr("no switch")));
  EXPECT_EQ(run.switches, 2) << run.log;
  ASSERT_EQ(run.layouts.size(), 3u);
  EXPECT_NE(run.layouts[1], run.layouts[0]);
  EXPECT_EQ(run.layouts[2], run.layouts[0]);  // the layout measured slow, taken again
  // The run ends on figures like the first: its prediction within 10% of the first plan's.
  EXPECT_NEAR(d.machine().plan()->predicted_step_seconds, run.first_prediction, 0.1 * run.first_prediction);
}

// After a switch for speed, the new plan is checked before any of its reports is judged. Site b computes
// 2x its figures from step 5 on: it is flagged and the run switches to b -> a, a taking the later ops. On
// the ops beyond its first cut, a then computes 1.5x their profile (ops costlier than profiled where they
// now run). Judged from the new plan's first report, a was flagged at its `window`-th report,
// before the switch check had its `window` + 1 steps. Now no report of a plan that a switch for speed
// began counts before the check has run: every straggler event after a switch comes after the check's,
// at a report of step boundary + window + 2 or later (1-based).
TEST(RunMachine, APlanASwitchForSpeedBeganIsCheckedBeforeItsSitesAreJudged) {
  RunConfig c = StragglerConfig(120);
  c.job.replication = false;
  Driver d(c);
  int first_cut = -1;  // a's last op under the first plan (a runs stage 0)
  const SimulatedRun run = RunTwoSitePipeline(&d, c, 120, [&](const std::string& site, int stage_last_op, int step) {
    if (site == "a" && first_cut < 0) first_cut = stage_last_op;
    if (site == "b") return step >= 5 ? 2.0 : 1.0;
    return first_cut >= 0 && stage_last_op > first_cut ? 1.5 : 1.0;
  });
  ASSERT_GE(run.switches, 1) << run.log;
  ASSERT_GE(run.stragglers.size(), 1u) << run.log;
  EXPECT_EQ(run.stragglers[0].site, "b") << run.log;
  const int64_t window = c.spec.elastic.window;
  for (size_t i = 0; i < run.switch_steps.size(); ++i) {
    const int64_t boundary = run.switch_steps[i];
    const int64_t next = i + 1 < run.switch_steps.size() ? run.switch_steps[i + 1] : c.steps;
    for (const auto& e : run.stragglers) {
      std::smatch m;
      ASSERT_TRUE(std::regex_search(e.text, m, std::regex("\\(to step ([0-9]+)\\)"))) << e.text;
      const int64_t at = std::stoll(m[1]);
      if (at <= boundary || at > next) continue;  // another plan's
      EXPECT_GE(at, boundary + window + 2)
          << "a report of the plan begun at step " << boundary << " was judged before its check:\n"
          << run.log;
    }
  }
  // The check ran first and kept the switch (b -> a within min_gain of a -> b); a was flagged only after it,
  // and the 8% its re-plan gains is not above min_gain: one switch in 120 steps.
  ASSERT_EQ(run.checks.size(), 1u) << run.log;
  EXPECT_THAT(run.checks[0].text, HasSubstr("kept")) << run.log;
  ASSERT_EQ(run.stragglers.size(), 2u) << run.log;
  EXPECT_EQ(run.stragglers[1].site, "a") << run.log;
  EXPECT_EQ(run.switches, 1) << run.log;
}
}  // namespace
}  // namespace meridian::coordinator
