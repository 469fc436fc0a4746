// The coordinator's state machine without a network: who may send and fetch the run's files.
#include "coordinator/coordinator.h"
#include "coordinator/step_figures.h"

#include <gtest/gtest.h>
#include <link.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include <gmock/gmock.h>
#include <nlohmann/json.hpp>

#include <string>
#include <vector>
#include "core/checkpoint_dir.h"
#include "core/files.h"

namespace meridian::coordinator {
namespace {

namespace fs = std::filesystem;

// The layering rule: the coordinator links no torch. What CMake links into meridian_coordinator
// (coordinator/link_closure.txt, written at configure time), and what this test binary, which links the
// coordinator library alone, has loaded.
TEST(CoordinatorLayering, TheCoordinatorLibraryLinksNoTorch) {
  std::ifstream in(fs::path(MERIDIAN_TEST_BINARY_DIR) / "coordinator" / "link_closure.txt");
  ASSERT_TRUE(in) << "link_closure.txt missing: re-run cmake";
  std::vector<std::string> libs;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) libs.push_back(line);
  for (const char* needed : {"meridian::core", "meridian::partitioner", "meridian::rpc", "meridian::proto"})
    EXPECT_NE(std::find(libs.begin(), libs.end(), needed), libs.end()) << needed;
  for (const auto& lib : libs)
    for (const char* banned : {"torch", "c10", "caffe2", "meridian::executor", "meridian::model_tools"})
      EXPECT_EQ(lib.find(banned), std::string::npos) << "the coordinator links " << lib;

  std::vector<std::string> loaded;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        static_cast<std::vector<std::string>*>(out)->push_back(info->dlpi_name ? info->dlpi_name : "");
        return 0;
      },
      &loaded);
  EXPECT_GT(loaded.size(), 3u);  // the binary, libc, libstdc++, gRPC, ...
  for (const auto& so : loaded)
    for (const char* banned : {"libtorch", "libc10"})
      EXPECT_EQ(so.find(banned), std::string::npos) << "the coordinator's test binary loaded " << so;
}

// Sends `content` as `path` from `site` for attempt `job`, as the service does: a grant, the bytes, the commit.
absl::Status Upload(Coordinator& c, const std::string& site, const std::string& job, const std::string& path,
                    const std::string& content) {
  auto grant = c.FileDestination(site, job, path);
  if (!grant.ok()) return grant.status();
  const std::string part = grant->path + ".part";
  std::ofstream(part) << content;
  absl::Status s =
      c.FileCommit(site, job, path, part, grant->path, static_cast<int64_t>(content.size()), core::Sha256Hex(content));
  if (!s.ok()) fs::remove(part);
  return s;
}

// A coordinator of sites a and b keeping files under `dir`, in attempt "j", where a writes stage 0's and b
// stage 1's (steps up to 100, files up to 1 MiB, a checkpoint every `interval` steps).
std::unique_ptr<Coordinator> TwoWriterStore(const fs::path& dir, int interval) {
  core::ClusterSpec spec;
  spec.name = "t";
  spec.sites = {{"a", {"127.0.0.1", 2}}, {"b", {"127.0.0.1", 3}}};
  auto c = std::make_unique<Coordinator>(spec, "run");
  c->SetFileDir(dir.string());
  c->BeginJob("j", {{"a", 0}, {"b", 1}});
  c->SetFileWriters({{"a", 0}, {"b", 1}}, 100, 1 << 20, interval, 0);
  return c;
}

// What a stage's writer sends as stage-K.json of step `step`: its stage of `num_stages`, describing the shard
// whose content is `shard`, holding one tensor.
std::string StageJson(int step, int stage, int num_stages, const std::string& shard) {
  return nlohmann::json{{"step", step},
                        {"stage", stage},
                        {"num_stages", num_stages},
                        {"shard", "stage-" + std::to_string(stage) + ".safetensors"},
                        {"sha256", core::Sha256Hex(shard)},
                        {"tensors", {"w"}}}
      .dump();
}

TEST(CoordinatorFiles, OnlyEachStagesWriterSendsItsOwnFilesOfTheRunningAttempt) {
  const fs::path dir = fs::temp_directory_path() / ("meridian_coordfiles_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  core::ClusterSpec spec;
  spec.name = "t";
  spec.sites = {{"a", {"127.0.0.1", 2}}, {"b", {"127.0.0.1", 3}}, {"c", {"127.0.0.1", 4}}};
  Coordinator c(spec, "run");
  EXPECT_EQ(c.FileDestination("a", "j1", "weights/stage-0.safetensors").status().code(),
            absl::StatusCode::kFailedPrecondition);  // no run directory yet
  c.SetFileDir(dir.string());
  c.BeginJob("j1");
  c.SetFileWriters({{"a", 0}, {"b", 1}}, 100, 1000);
  auto ok = c.FileDestination("a", "j1", "weights/stage-0.safetensors");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->path, (dir / "weights" / "stage-0.safetensors").string());
  EXPECT_EQ(ok->max_bytes, 1000);
  EXPECT_TRUE(fs::is_directory(dir / "weights"));
  // No checkpoint interval: a checkpoint only at a switch's step boundary.
  EXPECT_EQ(c.FileDestination("b", "j1", "checkpoints/step-100/stage-1.json").status().code(),
            absl::StatusCode::kInvalidArgument);
  c.SetBoundary("j1", 100);
  auto ckpt = c.FileDestination("b", "j1", "checkpoints/step-100/stage-1.json");
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(c.FileDestination("a", "j1", "weights/stage-1.safetensors").status().code(),
            absl::StatusCode::kPermissionDenied);  // b's stage
  EXPECT_EQ(c.FileDestination("c", "j1", "weights/stage-0.safetensors").status().code(),
            absl::StatusCode::kPermissionDenied);  // a spare site
  EXPECT_EQ(c.FileDestination("a", "j0", "weights/stage-0.safetensors").status().code(),
            absl::StatusCode::kFailedPrecondition);  // another attempt
  EXPECT_EQ(c.FileDestination("a", "j1", "checkpoints/step-101/stage-0.json").status().code(),
            absl::StatusCode::kInvalidArgument);  // beyond the job's steps
  std::ofstream((dir / "part").string()) << "x";
  EXPECT_TRUE(
      c.FileCommit("a", "j1", "weights/stage-0.safetensors", (dir / "part").string(), ok->path, 1, core::Sha256Hex("x"))
          .ok());
  EXPECT_TRUE(fs::exists(ok->path));
  EXPECT_FALSE(fs::exists(dir / "part"));
  // A new attempt: the old one's uploads are refused, and nobody writes until told.
  c.BeginJob("j2");
  std::ofstream((dir / "part").string()) << "y";
  EXPECT_EQ(
      c.FileCommit("a", "j1", "weights/stage-0.safetensors", (dir / "part").string(), ok->path, 1, core::Sha256Hex("y"))
          .code(),
      absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(fs::exists(dir / "part"));  // the service deletes it
  EXPECT_EQ(c.FileDestination("a", "j2", "weights/stage-0.safetensors").status().code(),
            absl::StatusCode::kPermissionDenied);
  // Fetching (since #19: only the sites of the running attempt, only the step it resumes from, only what
  // the coordinator has).
  c.BeginJob("j3", {{"a", 0}, {"c", 1}});
  c.SetFileWriters({{"a", 0}, {"c", 1}}, 100, 1000, 50, 100,
                   {{"c", {"checkpoints/step-100/stage-1.json", "checkpoints/step-100/stage-1.safetensors"}},
                    {"a", {"checkpoints/step-100/stage-1.json"}}});
  EXPECT_EQ(c.FileSource("c", "checkpoints/step-100/stage-1.json").status().code(), absl::StatusCode::kNotFound);
  std::ofstream(dir / "checkpoints" / "step-100" / "stage-1.json") << "{}";
  auto src = c.FileSource("c", "checkpoints/step-100/stage-1.json");
  ASSERT_TRUE(src.ok()) << src.status();
  EXPECT_EQ(*src, (dir / "checkpoints" / "step-100" / "stage-1.json").string());
  EXPECT_EQ(c.FileSource("b", "checkpoints/step-100/stage-1.json").status().code(),
            absl::StatusCode::kPermissionDenied);  // not a site of the attempt
  EXPECT_EQ(c.FileSource("c", "checkpoints/step-50/stage-1.json").status().code(),
            absl::StatusCode::kPermissionDenied);  // not the resume point
  std::ofstream(dir / "checkpoints" / "step-100" / "stage-1.safetensors") << "x";
  EXPECT_TRUE(c.FileSource("c", "checkpoints/step-100/stage-1.safetensors").ok());
  auto foreign = c.FileSource("a", "checkpoints/step-100/stage-1.safetensors");  // another stage's shard
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(foreign.status().message()), testing::HasSubstr("holds none of its stage's tensors"));
  fs::remove_all(dir);
}

// The store's quota bounds what sites may upload, whatever each file's own bound.
TEST(CoordinatorFiles, UploadsAreGrantedWhatIsLeftOfTheStoresQuota) {
  const fs::path dir = fs::temp_directory_path() / ("meridian_quota_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  core::ClusterSpec spec;
  spec.name = "t";
  spec.sites = {{"a", {"127.0.0.1", 2}}};
  Coordinator c(spec, "run");
  c.SetFileDir(dir.string());
  c.BeginJob("j", {{"a", 0}});
  c.SetFileWriters({{"a", 0}}, 100, 1 << 20, 10, 0, {}, 5000);
  auto first = c.FileDestination("a", "j", "checkpoints/step-10/stage-0.safetensors");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->max_bytes, 5000);  // the quota, below the file's own bound
  std::ofstream(first->path) << std::string(4000, 'x');
  auto second = c.FileDestination("a", "j", "checkpoints/step-10/stage-0.json");
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->max_bytes, 1000);
  fs::create_directories(dir / "weights");
  std::ofstream(dir / "weights" / "stage-0.safetensors") << std::string(1000, 'x');  // weights count too
  auto full = c.FileDestination("a", "j", "checkpoints/step-10/stage-0.json");
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(full.status().message()), testing::HasSubstr("the coordinator's store is full"));
  fs::remove_all(dir);
}

// A compromised stage writer cannot make a forged or premature step count: a step counts only once the
// coordinator has each writer's shard and a JSON that describes it, and has written the manifest.
TEST(CoordinatorFiles, OnlyAManifestedStepCountsAndForgedUploadsAreRefused) {
  const fs::path dir = fs::temp_directory_path() / ("meridian_manifest_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto store = TwoWriterStore(dir, 10);
  Coordinator& c = *store;
  // Steps that are not checkpoint steps, or far ahead of the run's progress (none yet).
  EXPECT_EQ(c.FileDestination("a", "j", "checkpoints/step-15/stage-0.safetensors").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.FileDestination("a", "j", "checkpoints/step-90/stage-0.safetensors").status().code(),
            absl::StatusCode::kInvalidArgument);
  auto upload = [&](const std::string& site, const std::string& path, const std::string& content) {
    return Upload(c, site, "j", path, content);
  };
  auto meta = [](int stage, int num_stages, const std::string& shard) {
    return StageJson(10, stage, num_stages, shard);
  };
  ASSERT_TRUE(upload("a", "checkpoints/step-10/stage-0.safetensors", "shard-a").ok());
  // The audit's forgery: a stage-0 JSON claiming the step has one stage.
  absl::Status forged = upload("a", "checkpoints/step-10/stage-0.json", meta(0, 1, "shard-a"));
  EXPECT_EQ(forged.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(forged.message()), ::testing::HasSubstr("the plan has stage 0 of 2"));
  // A JSON vouching for another shard than the one sent.
  EXPECT_EQ(upload("a", "checkpoints/step-10/stage-0.json", meta(0, 2, "other")).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(upload("a", "checkpoints/step-10/stage-0.json", meta(0, 2, "shard-a")).ok());
  EXPECT_FALSE(fs::exists(dir / "checkpoints" / "step-10" / core::kManifestFile));  // b's stage is missing
  EXPECT_EQ(core::FindLatestManifested((dir / "checkpoints").string()).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(upload("b", "checkpoints/step-10/stage-1.safetensors", "shard-b").ok());
  ASSERT_TRUE(upload("b", "checkpoints/step-10/stage-1.json", meta(1, 2, "shard-b")).ok());
  auto found = core::FindLatestManifested((dir / "checkpoints").string());
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->step, 10);
  EXPECT_EQ(found->files.size(), 4u);
  // A shard replaced behind the coordinator's back no longer counts.
  std::ofstream(dir / "checkpoints" / "step-10" / "stage-1.safetensors") << "tampered";
  EXPECT_FALSE(core::FindLatestManifested((dir / "checkpoints").string()).ok());
  fs::remove_all(dir);
}

// A switch's step boundary (#21) is a checkpoint step whatever the interval: every stage saves it, and
// its manifest makes it count, as an interval's step. Found by a DiLoCo drain with store: coordinator,
// whose boundary step 760 was refused ("not a checkpoint step") and the run fell back. Another attempt's
// boundary, and steps that are neither, are refused.
TEST(CoordinatorFiles, AStepBoundaryIsACheckpointStepWhateverTheInterval) {
  const fs::path dir = fs::temp_directory_path() / ("meridian_boundary_" + std::to_string(::getpid()));
  for (const int interval : {10, 0}) {
    SCOPED_TRACE(interval);
    fs::remove_all(dir);
    auto store = TwoWriterStore(dir, interval);
    Coordinator& c = *store;
    c.SetBoundary("j0", 17);  // an attempt that ended
    absl::Status refused = Upload(c, "a", "j", "checkpoints/step-17/stage-0.safetensors", "shard-a");
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(
        std::string(refused.message()),
        ::testing::HasSubstr(interval ? "not a checkpoint step" : "checkpoints only at a switch's step boundary"));
    c.SetBoundary("j", 17);
    EXPECT_EQ(Upload(c, "a", "j", "checkpoints/step-16/stage-0.safetensors", "x").code(),
              absl::StatusCode::kInvalidArgument);
    for (const auto& [site, stage] : {std::pair{"a", 0}, {"b", 1}}) {
      const std::string shard = std::string("shard-") + site;
      const std::string name = "checkpoints/step-17/stage-" + std::to_string(stage);
      ASSERT_TRUE(Upload(c, site, "j", name + ".safetensors", shard).ok());
      ASSERT_TRUE(Upload(c, site, "j", name + ".json", StageJson(17, stage, 2, shard)).ok());
    }
    auto found = core::FindLatestManifested((dir / "checkpoints").string());
    ASSERT_TRUE(found.ok()) << found.status();
    EXPECT_EQ(found->step, 17);
  }
  fs::remove_all(dir);
}

// DiLoCo round states (#17): only replica R of stage K sends stage-K.replica-R.*, its JSON must describe
// the shard it sent, and the manifest lists each round state as it completes -- the step counts without
// them, and a round state replaced afterwards is left out, not the step.
TEST(CoordinatorFiles, EachDilocoReplicaSendsOnlyItsOwnRoundStateAndTheManifestListsIt) {
  const fs::path dir = fs::temp_directory_path() / ("meridian_rounds_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  core::ClusterSpec spec;
  spec.name = "t";
  spec.sites = {{"a", {"127.0.0.1", 2}}, {"b", {"127.0.0.1", 3}}, {"c", {"127.0.0.1", 4}}};
  Coordinator c(spec, "run");
  c.SetFileDir(dir.string());
  c.BeginJob("j", {{"a", 0}, {"b", 0}, {"c", 1}});
  c.SetFileWriters({{"a", 0}, {"c", 1}}, 100, 1 << 20, 10, 0, {}, 0, {{"a", {0, 0}}, {"b", {0, 1}}});
  auto upload = [&](const std::string& site, const std::string& path, const std::string& content) {
    return Upload(c, site, "j", path, content);
  };
  auto stage_meta = [](int stage, const std::string& shard) {
    return nlohmann::json{{"step", 10},
                          {"stage", stage},
                          {"num_stages", 2},
                          {"shard", "stage-" + std::to_string(stage) + ".safetensors"},
                          {"sha256", core::Sha256Hex(shard)},
                          {"tensors", {"w"}}}
        .dump();
  };
  auto round_meta = [](int replica, const std::string& shard) {
    core::ReplicaMeta m;
    m.step = 10;
    m.stage = 0;
    m.num_stages = 2;
    m.replica = replica;
    m.last_op = 2;
    m.micro_batches = {2, 2};
    m.shard = core::ReplicaShardName(0, replica);
    m.sha256 = core::Sha256Hex(shard);
    return core::ReplicaMetaJson(m);
  };
  // b is replica 1 of stage 0: not the stage's writer, not replica 0, not c's stage.
  auto refused = c.FileDestination("b", "j", "checkpoints/step-10/stage-0.replica-0.safetensors");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(refused.status().message()),
              testing::HasSubstr("it is replica 1 of stage 0, not replica 0 of stage 0"));
  EXPECT_EQ(c.FileDestination("b", "j", "checkpoints/step-10/stage-0.safetensors").status().code(),
            absl::StatusCode::kPermissionDenied);
  auto spare = c.FileDestination("c", "j", "checkpoints/step-10/stage-1.replica-0.safetensors");
  EXPECT_THAT(std::string(spare.status().message()), testing::HasSubstr("it is no DiLoCo replica"));
  ASSERT_TRUE(upload("b", "checkpoints/step-10/stage-0.replica-1.safetensors", "round-b").ok());
  // A JSON vouching for another shard, or describing another replica.
  EXPECT_EQ(upload("b", "checkpoints/step-10/stage-0.replica-1.json", round_meta(1, "other")).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(upload("b", "checkpoints/step-10/stage-0.replica-1.json", round_meta(0, "round-b")).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(upload("b", "checkpoints/step-10/stage-0.replica-1.json", stage_meta(0, "round-b")).code(),
            absl::StatusCode::kInvalidArgument);  // a stage's description is no round state's
  ASSERT_TRUE(upload("b", "checkpoints/step-10/stage-0.replica-1.json", round_meta(1, "round-b")).ok());
  EXPECT_FALSE(fs::exists(dir / "checkpoints" / "step-10" / core::kManifestFile));  // no stage's shard yet
  for (const auto& [site, stage] : {std::pair<std::string, int>{"a", 0}, {"c", 1}}) {
    const std::string shard = "shard-" + site;
    ASSERT_TRUE(upload(site, "checkpoints/step-10/stage-" + std::to_string(stage) + ".safetensors", shard).ok());
    ASSERT_TRUE(
        upload(site, "checkpoints/step-10/stage-" + std::to_string(stage) + ".json", stage_meta(stage, shard)).ok());
  }
  // Manifested with b's round state; a's arrives after and is listed too.
  auto found = core::FindLatestManifested((dir / "checkpoints").string());
  ASSERT_TRUE(found.ok()) << found.status();
  ASSERT_EQ(found->round_states[0].size(), 1u);
  EXPECT_EQ(found->round_states[0].at(1).micro_batches, (std::vector<int>{2, 2}));
  ASSERT_TRUE(upload("a", "checkpoints/step-10/stage-0.replica-0.safetensors", "round-a").ok());
  ASSERT_TRUE(upload("a", "checkpoints/step-10/stage-0.replica-0.json", round_meta(0, "round-a")).ok());
  found = core::FindLatestManifested((dir / "checkpoints").string());
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->round_states[0].size(), 2u);
  EXPECT_EQ(found->files.size(), 4u);  // the stages' files; round states apart
  std::string why;
  EXPECT_TRUE(core::RoundStatesMatch(found->round_states[0], {0, 2, 0, 2, {2, 2}}, &why)) << why;
  EXPECT_FALSE(core::RoundStatesMatch(found->round_states[0], {0, 2, 0, 2, {3, 1}}, &why));
  // b's round state replaced behind the coordinator's back: left out, the step still counts.
  std::ofstream(dir / "checkpoints" / "step-10" / core::ReplicaShardName(0, 1)) << "tampered";
  found = core::FindLatestManifested((dir / "checkpoints").string());
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->round_states[0].size(), 1u);
  EXPECT_THAT(found->round_state_problems, testing::HasSubstr("stage-0.replica-1.safetensors: does not match"));
  fs::remove_all(dir);
}

// The run as JSON (/api/run, `meridian status --json`): steps numbered in the order recorded (a resumed
// attempt's steps come again under new numbers), `after` returning only the newer ones, the tokens/s the
// plan predicts, events with their site, and the event log on disk with a hostile site's bytes replaced.
TEST(CoordinatorRunJson, StepsEventsAndPredictionsAsTheDashboardReadsThem) {
  const fs::path dir = fs::temp_directory_path() / ("meridian_runjson_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  core::ClusterSpec spec;
  spec.name = "t";
  spec.sites = {{"a", {"127.0.0.1", 2}}, {"b", {"127.0.0.1", 3}}};
  Coordinator c(spec, "run");
  c.SetEventLog((dir / "events.jsonl").string());
  c.SetRunFacts(100, 64);
  c.SetRunInfo(R"({"sites": [{"name": "a", "flops_per_second": 2e9}], "links": [{"from": "a", "to": "b",
                   "bandwidth_bytes_per_second": 1e6, "latency_seconds": 0.01}]})",
               "{}", R"({"predicted_step_seconds": 0.5, "compute_bound_seconds": 0.25, "stages": []})");
  c.BeginJob("j1", {{"a", 0}, {"b", 1}});
  for (int step : {1, 2, 3, 2, 3})  // the attempt after a resume from step 1 trains 2 and 3 again
    c.RecordStep({{"step", step}, {"loss", 1.0 / step}});
  c.RecordStep(nlohmann::json());  // not a step: ignored
  c.RecordEvent("lost", "b", "no heartbeat for 5 s");
  c.RecordEvent("stage_failed", "b", std::string("bad \xff bytes"));
  auto j = nlohmann::json::parse(c.RunJson());
  ASSERT_EQ(j["steps"].size(), 5u);
  EXPECT_EQ(j["steps"][3]["step"], 2);
  EXPECT_EQ(j["steps"][3]["seq"], 4);
  auto newer = nlohmann::json::parse(c.RunJson(3));
  ASSERT_EQ(newer["steps"].size(), 2u);
  EXPECT_EQ(newer["steps"][0]["seq"], 4);
  EXPECT_DOUBLE_EQ(j["run"]["predicted_tokens_per_second"].get<double>(), 128.0);
  EXPECT_DOUBLE_EQ(j["run"]["compute_bound_tokens_per_second"].get<double>(), 256.0);
  EXPECT_EQ(j["run"]["steps"], 100);
  EXPECT_EQ(j["links"].size(), 1u);
  ASSERT_EQ(j["sites"].size(), 2u);
  EXPECT_EQ(j["sites"][0]["stage"], 0);
  EXPECT_DOUBLE_EQ(j["sites"][0]["gemm_flops_per_second"].get<double>(), 2e9);
  EXPECT_FALSE(j["sites"][1].contains("gemm_flops_per_second"));
  EXPECT_FALSE(j["sites"][0].contains("metrics"));  // none reported yet
  ASSERT_EQ(j["events"].size(), 2u);
  EXPECT_EQ(j["events"][0]["kind"], "lost");
  EXPECT_EQ(j["events"][0]["site"], "b");
  std::ifstream log(dir / "events.jsonl");
  std::vector<nlohmann::json> lines;
  for (std::string l; std::getline(log, l);) lines.push_back(nlohmann::json::parse(l));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[1]["kind"], "stage_failed");
  EXPECT_EQ(lines[1]["text"], "bad \xef\xbf\xbd bytes");  // U+FFFD
  // A stage's latest step: every step figure (step_figures.h) under its key, and the bytes it sent.
  v1::MetricsReport r;
  r.set_job_id("j1");
  r.set_site("b");
  r.set_stage(1);
  r.set_step(4);
  r.set_step_seconds(2.5);
  r.set_wire_bytes(1000);
  r.set_raw_bytes(4000);
  for (size_t i = 0; i < kStepFigures.size(); ++i) {
    const std::string setter = kStepFigures[i].key;  // each figure its own value: 0.1, 0.2, ...
    const auto* field = r.GetDescriptor()->FindFieldByName(setter);
    ASSERT_NE(field, nullptr) << setter;
    if (kStepFigures[i].count)
      r.GetReflection()->SetInt64(&r, field, static_cast<int64_t>(i + 1));
    else
      r.GetReflection()->SetDouble(&r, field, 0.1 * static_cast<double>(i + 1));
  }
  ASSERT_TRUE(c.Metrics(r).ok());
  const auto m = nlohmann::json::parse(c.RunJson())["sites"][1]["metrics"];
  EXPECT_EQ(m["step"], 5);
  EXPECT_DOUBLE_EQ(m["step_seconds"].get<double>(), 2.5);
  for (size_t i = 0; i < kStepFigures.size(); ++i) {
    if (kStepFigures[i].count) {
      EXPECT_TRUE(m[kStepFigures[i].key].is_number_integer()) << kStepFigures[i].key;
      EXPECT_EQ(m[kStepFigures[i].key].get<int64_t>(), static_cast<int64_t>(i + 1)) << kStepFigures[i].key;
    } else {
      EXPECT_DOUBLE_EQ(m[kStepFigures[i].key].get<double>(), 0.1 * static_cast<double>(i + 1)) << kStepFigures[i].key;
    }
  }
  EXPECT_EQ(m["sent_bytes"], 1000);
  EXPECT_EQ(m["uncompressed_bytes"], 4000);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace meridian::coordinator
