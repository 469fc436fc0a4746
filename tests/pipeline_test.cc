// Distributed training with real executor processes over mutual TLS on loopback, checked against the
// single-process reference trainer (`meridian train-local`).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <regex>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/certs.h"
#include "core/safetensors.h"
#include "partitioner/schedule.h"
#include "tests/process.h"
#include "tests/test_util.h"
#include "tests/wan/harness.h"

namespace meridian {
namespace {

namespace fs = std::filesystem;
using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::Process;
using namespace std::chrono_literals;

namespace partitioner_json {
nlohmann::json Load(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in, nullptr, false);
}
}  // namespace partitioner_json

using testing::Bin;
using testing::FreePort;

// A 2-layer LLaMA (6 ops: embed, 2 x (attn, mlp), head) with grouped-query attention.
const char kConfig[] = R"({"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": false})";

struct Stage {
  int first, last;
  std::vector<int> shares = {};  // replicas: micro-batches per step of each site (empty: one site)
  int in_flight = 0;             // micro-batches in flight (0: 1F1B's)
  bool recompute = false;        // activation recomputation
};

class PipelineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("meridian_pipeline_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "model");
    std::ofstream(dir_ / "model" / "config.json") << kConfig;
    core::ClusterSpec spec;
    spec.name = "pipe";
    spec.coordinator = {"127.0.0.1", 1};
    for (const char* s : {"a", "b", "c", "d"}) spec.sites.push_back({s, {"127.0.0.1", 2}});
    std::vector<std::string> w;
    ASSERT_TRUE(core::InitClusterCerts(spec, (dir_ / "certs").string(), {}, &w).ok());
    ::setenv("OPENBLAS_NUM_THREADS", "1", 1);
    ::setenv("OMP_NUM_THREADS", "1", 1);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Job(const std::string& name, int steps, const std::string& fwd = "identity",
                  const std::string& bwd = "identity", int seq = 16) {
    std::string path = (dir_ / (name + ".yaml")).string();
    std::ofstream(path) << "job:\n  model: model\n  data: synthetic\n  steps: " << steps
                        << "\n  global_batch: 4\n  micro_batches: 4\n  sequence_length: " << seq
                        << "\n  seed: 7\n  optimizer: {name: adamw, lr: 0.01, weight_decay: 0.01, warmup_steps: 1, "
                           "grad_clip: 0.5}\n  compression: {policy: fixed, activations: "
                        << fwd << ", gradients: " << bwd << "}\n";
    return path;
  }

  // `meridian train-local` of `job` into dir_/`out`; its weights.
  std::map<std::string, core::Tensor> Reference(const std::string& job, std::vector<double>* losses = nullptr,
                                                const std::string& out_dir = "local") {
    Process p(Bin("meridian") + " train-local " + job + " --out " + (dir_ / out_dir).string());
    std::string out = p.ReadAll(120s);
    EXPECT_EQ(p.Wait(60s), 0) << out;
    if (losses) *losses = Losses(out);
    auto f = core::ReadSafetensors((dir_ / out_dir / "model.safetensors").string());
    EXPECT_TRUE(f.ok()) << f.status();
    return f.ok() ? f->tensors : std::map<std::string, core::Tensor>{};
  }

  static std::vector<double> Losses(const std::string& out) {
    std::vector<double> l;
    std::istringstream in(out);
    for (std::string line; std::getline(in, line);)
      if (line.rfind("step ", 0) == 0) l.push_back(std::stod(line.substr(line.find("loss ") + 5)));
    return l;
  }

  // Runs one executor process per site (one per stage, or one per replica: sites a, b, c, d in order);
  // returns the merged final parameters and the loss log. `logs` gets every process's output.
  std::map<std::string, core::Tensor> Distributed(const std::string& job, const std::vector<Stage>& stages,
                                                  const std::string& fwd, const std::string& bwd,
                                                  std::vector<double>* losses, const std::string& extra = "",
                                                  std::string* log = nullptr, const std::string& grad = "identity",
                                                  std::vector<std::string>* logs = nullptr) {
    const char* names[] = {"a", "b", "c", "d"};
    std::vector<std::vector<int>> site_of(stages.size());  // indices into names
    std::vector<int> ports;
    for (size_t k = 0; k < stages.size(); ++k)
      for (size_t r = 0; r < std::max<size_t>(1, stages[k].shares.size()); ++r) {
        site_of[k].push_back(static_cast<int>(ports.size()));
        ports.push_back(FreePort());
      }
    auto group = [&](size_t k) {
      std::string g = "[";
      for (size_t r = 0; r < site_of[k].size(); ++r) {
        const int i = site_of[k][r];
        g += std::string(r ? ", " : "") + "{\"site\": \"" + names[i] +
             "\", \"address\": \"127.0.0.1:" + std::to_string(ports[i]) + "\"" +
             (stages[k].shares.empty() ? "" : ", \"micro_batches\": " + std::to_string(stages[k].shares[r])) + "}";
      }
      return g + "]";
    };
    std::vector<std::unique_ptr<Process>> procs;
    fs::path out = dir_ / ("dist" + std::to_string(stages.size()));
    fs::remove_all(out);  // this run must not read an earlier run's shards
    fs::create_directories(out);
    for (size_t k = 0; k < stages.size(); ++k) {
      std::string a = "{\"stage\": " + std::to_string(k) + ", \"num_stages\": " + std::to_string(stages.size()) +
                      ", \"first_op\": " + std::to_string(stages[k].first) +
                      ", \"last_op\": " + std::to_string(stages[k].last) + ", \"forward_codec\": \"" + fwd +
                      "\", \"prev_forward_codec\": \"" + fwd + "\", \"backward_codec\": \"" + bwd +
                      "\", \"gradient_codec\": \"" + grad + "\", \"replicas\": " + group(k) + assignment_extra_;
      if (stages[k].in_flight > 0) a += ", \"in_flight\": " + std::to_string(stages[k].in_flight);
      if (stages[k].recompute) a += ", \"recompute\": true";
      if (k > 0) a += ", \"prev_replicas\": " + group(k - 1);
      if (k + 1 < stages.size()) a += ", \"next_replicas\": " + group(k + 1);
      std::string apath = (out.string() + "-assign" + std::to_string(k) + ".json");
      std::ofstream(apath) << a << "}";
      for (int i : site_of[k])
        procs.push_back(std::make_unique<Process>(
            Bin("meridian-executor") + " --site " + names[i] + " --certs " +
            (dir_ / "certs" / "bundles" / names[i]).string() + " --listen 127.0.0.1:" + std::to_string(ports[i]) +
            " --assignment " + apath + " --job " + job + " --out " + out.string() + " " + extra + " 2>&1"));
    }
    // Every process's output at once: the stages run in lockstep, and one blocked on a full pipe while
    // this reads another to its end would stall them all.
    std::vector<std::string> outputs(procs.size());
    std::vector<std::thread> readers;
    for (size_t i = 0; i < procs.size(); ++i) readers.emplace_back([&, i] { outputs[i] = procs[i]->ReadAll(300s); });
    for (auto& r : readers) r.join();
    const std::string& log0 = outputs[0];
    if (log) *log = log0;
    if (logs) *logs = outputs;
    for (size_t i = 0; i < procs.size(); ++i) {
      EXPECT_EQ(procs[i]->Wait(120s), 0) << "executor " << i << ":\n" << outputs[i];
      // No frame replaced another of the same key in an inbox (rpc::TensorInbox::replaced): none was lost.
      EXPECT_THAT(outputs[i], Not(HasSubstr("a peer sent a key twice"))) << "executor " << i;
    }
    if (losses) *losses = Losses(log0);  // stage 0 prints the loss relayed from the last stage
    std::map<std::string, core::Tensor> merged;
    for (size_t k = 0; k < stages.size(); ++k) {
      auto f = core::ReadSafetensors((out / ("stage-" + std::to_string(k) + ".safetensors")).string());
      EXPECT_TRUE(f.ok()) << f.status();
      if (f.ok()) merged.insert(f->tensors.begin(), f->tensors.end());
    }
    return merged;
  }

  // dir_/model for text data: a SentencePiece tokenizer of `vocab` pieces trained on `text` (meridian
  // tokenizer train) and the model config `config_json`.
  void TextModel(const fs::path& text, int vocab, const std::string& config_json) {
    Process tok(Bin("meridian") + " tokenizer train --input " + text.string() + " --vocab-size " +
                std::to_string(vocab) + " --out " + (dir_ / "model").string() + " 2>&1");
    std::string out = tok.ReadAll(60s);
    ASSERT_EQ(tok.Wait(30s), 0) << out;
    std::ofstream(dir_ / "model" / "config.json") << config_json;
  }

  void ExpectClose(const std::map<std::string, core::Tensor>& got, const std::map<std::string, core::Tensor>& want) {
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, t] : want) {
      ASSERT_TRUE(got.count(name)) << name;
      ASSERT_EQ(got.at(name).shape, t.shape) << name;
      EXPECT_LE(testing::RelativeL2(got.at(name), t), 1e-5) << name;
    }
  }

  fs::path dir_;
  std::string assignment_extra_;  // more assignment JSON fields, e.g. ", \"bucket_bytes\": 4096"
};

// The mean loss of the last `n` steps. With synthetic data one step's loss is one batch of 64 tokens, a tenth of them
// random (ln 64 each), so it swings by tens of percent from step to step; both runs see the same batches.
double TailMean(const std::vector<double>& losses, size_t n) {
  EXPECT_GE(losses.size(), n);
  n = std::min(n, losses.size());
  return std::accumulate(losses.end() - n, losses.end(), 0.0) / static_cast<double>(n);
}

TEST_F(PipelineTest, OneTwoAndThreeExecutorsMatchTheSingleProcessTrainer) {
  std::string job = Job("job", 4);
  auto want = Reference(job);
  ASSERT_EQ(want.size(), 21u);  // embed, 2 x (5 attention + 4 MLP), norm, lm_head
  ExpectClose(Distributed(job, {{0, 5}}, "identity", "identity", nullptr), want);
  ExpectClose(Distributed(job, {{0, 2}, {3, 5}}, "identity", "identity", nullptr), want);
  ExpectClose(Distributed(job, {{0, 1}, {2, 3}, {4, 5}}, "identity", "identity", nullptr), want);
}

// Stages that keep more micro-batches in flight than 1F1B (the planner's depth for long round trips) run
// another order of the same passes: the result still equals the single-process trainer.
TEST_F(PipelineTest, DeeperPipelinesMatchTheSingleProcessTrainer) {
  std::string job = Job("job", 4);
  auto want = Reference(job);
  ExpectClose(Distributed(job, {{0, 1, {}, 4}, {2, 3, {}, 3}, {4, 5, {}, 1}}, "identity", "identity", nullptr), want);
  ExpectClose(Distributed(job, {{0, 2, {}, 4}, {3, 5, {}, 1}}, "identity", "identity", nullptr), want);
  // Replicas of a deep stage run their micro-batches in the same order.
  ExpectClose(Distributed(job, {{0, 2, {2, 2}, 4}, {3, 5, {}, 1}}, "identity", "identity", nullptr), want);
}

// Stages that recompute their activations (the forward pass again before each backward pass, keeping
// only the inputs in flight) train exactly what the single-process trainer does, at any depth, the last
// stage and replicas included; and each backward pass is preceded by its micro-batch's recomputation.
TEST_F(PipelineTest, RecomputingStagesMatchTheSingleProcessTrainer) {
  const fs::path trace = dir_ / "trace";
  fs::create_directories(trace);
  ::setenv("MERIDIAN_TRACE_DIR", trace.string().c_str(), 1);
  std::string job = Job("job", 3);
  auto want = Reference(job);
  ExpectClose(Distributed(job, {{0, 1, {}, 4, true}, {2, 3, {}, 3, true}, {4, 5, {}, 1, true}}, "identity", "identity",
                          nullptr),
              want);
  ::unsetenv("MERIDIAN_TRACE_DIR");
  for (int k = 0; k < 3; ++k) {
    std::ifstream in(trace / ("trace-" + std::string(1, "abc"[k]) + "-stage" + std::to_string(k) + ".jsonl"));
    ASSERT_TRUE(in) << "stage " << k;
    int steps = 0;
    for (std::string line; std::getline(in, line); ++steps) {
      int recomputed = -1, backward = 0, sends = 0, reads = 0;
      const auto j = nlohmann::json::parse(line);
      for (const auto& iv : j["intervals"]) {
        const std::string what = iv[0];
        sends += what == "send";
        reads += what == "data";
        if (what == "R") recomputed = iv[1].get<int>();
        if (what == "B") {
          EXPECT_EQ(recomputed, iv[1].get<int>()) << "stage " << k << ": " << line;
          recomputed = -1;
          ++backward;
        }
      }
      EXPECT_EQ(backward, 4) << line;
      // Each activation it sends on and each gradient it sends back; the tokens at the first and last stage.
      EXPECT_EQ(sends, k == 1 ? 8 : 4) << line;
      EXPECT_EQ(reads, k == 1 ? 0 : 4) << line;
    }
    EXPECT_EQ(steps, 3) << "stage " << k;
  }
  // A replicated recomputing stage beside one that keeps its activations.
  ExpectClose(Distributed(job, {{0, 2, {2, 2}, 4, true}, {3, 5, {}, 1}}, "identity", "identity", nullptr), want);
}

// MERIDIAN_TRACE_DIR: each stage writes one line per step with its passes in its schedule's order, each
// pass of a stage that receives preceded by its wait, every interval inside the step and none overlapping.
TEST_F(PipelineTest, StepTimelinesRecordEveryPassInTheSchedulesOrder) {
  const fs::path trace = dir_ / "trace";
  fs::create_directories(trace);
  ::setenv("MERIDIAN_TRACE_DIR", trace.string().c_str(), 1);
  std::string job = Job("job", 3);
  Distributed(job, {{0, 2, {}, 3}, {3, 5, {}, 1}}, "identity", "identity", nullptr);
  ::unsetenv("MERIDIAN_TRACE_DIR");
  const int depth[] = {3, 1};
  for (int k = 0; k < 2; ++k) {
    std::ifstream in(trace / ("trace-" + std::string(k == 0 ? "a" : "b") + "-stage" + std::to_string(k) + ".jsonl"));
    ASSERT_TRUE(in) << "stage " << k;
    int steps = 0;
    double last_start = -1;
    for (std::string line; std::getline(in, line); ++steps) {
      auto j = nlohmann::json::parse(line);
      EXPECT_EQ(j["step"].get<int>(), steps + 1);
      EXPECT_GT(j["start"].get<double>(), last_start);
      last_start = j["start"].get<double>();
      const double end = j["end"].get<double>();
      std::vector<std::pair<char, int>> passes;
      double t = 0;
      std::string before;  // the interval before each pass
      for (const auto& iv : j["intervals"]) {
        const std::string what = iv[0];
        const double s = iv[2], e = iv[3];
        EXPECT_GE(s, t - 1e-9) << line;  // in time order, none overlapping
        EXPECT_GE(e, s);
        EXPECT_LE(e, end + 1e-9);
        t = e;
        if (what == "F" || what == "B") {
          passes.push_back({what[0], iv[1].get<int>()});
          if (k == 1 && what == "F") EXPECT_EQ(before, "wait_F") << line;  // its input came first
          if (k == 0 && what == "B") EXPECT_EQ(before, "wait_B") << line;
        }
        before = what;
      }
      EXPECT_EQ(passes, partitioner::PipelineSchedule(k, 2, 4, depth[k])) << line;
      EXPECT_EQ(before, "opt") << line;  // the step ends with the optimizer
    }
    EXPECT_EQ(steps, 3) << "stage " << k;
  }
}

// Stage 0's activations cross a 1 Mbit/s link (tbf in test namespaces), with all four micro-batches of a
// step in flight (a deep pipeline puts a step's activations on the link at once): the link sets the
// pace, yet the compute thread never waits for it -- it queues each frame and goes on, and waits only
// for gradients.
// With a queue of one byte (every send waits until the one before it was written, as sends did before
// queued senders) the same stage is blocked sending for much of its step: the measurement tells them apart.
// That control must hold on a loaded machine too, where compute is slower and the link drains more of
// each frame between sends: a clean-clone CI run measured 17% at 2 Mbit/s with 64 KiB socket buffers; at
// 1 Mbit/s with 8 KiB ones this machine measures about 45% beside two busy loops, 0% with the queue.
TEST_F(PipelineTest, SendsOverASlowLinkDoNotBlockTheComputeThread) {
  if (!testing::IsRoot()) GTEST_SKIP() << "WAN emulation needs root (network namespaces and tc); not root";
  auto wan = testing::WanHarness::Create({"a", "b"}, {{"a", "b", 1, 0}});
  ASSERT_TRUE(wan.ok()) << wan.status();
  // The data is scaled down from a real model's (64 KiB of activations per micro-batch instead of many
  // MiB), so the sending site's TCP buffers are too (the namespace's own sysctl), or they would hold a
  // whole step and no send could ever block.
  ASSERT_EQ(std::system(((*wan)->Exec("a") + "sysctl -q -w net.ipv4.tcp_wmem='4096 8192 8192'").c_str()), 0);
  const std::string job = Job("slow", 4, "identity", "identity", 512);
  int port = 17600;
  // Returns stage 0's seconds blocked sending and its step seconds, summed over the steps.
  auto run = [&](int64_t queue_bytes) -> std::pair<double, double> {
    const std::string a = (*wan)->Address("a", "b") + ":" + std::to_string(port++);
    const std::string b = (*wan)->Address("b", "a") + ":" + std::to_string(port++);
    const std::string certs = (dir_ / "certs").string();
    std::ofstream(dir_ / "s0.json") << "{\"stage\": 0, \"num_stages\": 2, \"first_op\": 0, \"last_op\": 2, "
                                       "\"in_flight\": 4, \"next_site\": \"b\", \"next_address\": \""
                                    << b << "\", \"send_queue_bytes\": " << queue_bytes << "}";
    std::ofstream(dir_ / "s1.json") << "{\"stage\": 1, \"num_stages\": 2, \"first_op\": 3, \"last_op\": 5, "
                                       "\"prev_site\": \"a\", \"prev_address\": \""
                                    << a << "\"}";
    Process p0((*wan)->Exec("a") + Bin("meridian-executor") + " --site a --certs " + certs + "/bundles/a --listen " +
               a + " --assignment " + (dir_ / "s0.json").string() + " --job " + job + " 2>&1");
    Process p1((*wan)->Exec("b") + Bin("meridian-executor") + " --site b --certs " + certs + "/bundles/b --listen " +
               b + " --assignment " + (dir_ / "s1.json").string() + " --job " + job + " 2>&1");
    const std::string out0 = p0.ReadAll(300s), out1 = p1.ReadAll(300s);
    EXPECT_EQ(p0.Wait(60s), 0) << out0;
    EXPECT_EQ(p1.Wait(60s), 0) << out1;
    std::regex line(
        R"(timing step \d+: ([0-9.]+) s, computing [0-9.]+ s, waiting [0-9.]+ s, blocked sending ([0-9.]+) s)");
    double blocked = 0, step = 0;
    int steps = 0;
    for (std::sregex_iterator it(out0.begin(), out0.end(), line), end; it != end; ++it, ++steps) {
      step += std::stod((*it)[1]);
      blocked += std::stod((*it)[2]);
    }
    EXPECT_EQ(steps, 4) << out0;
    return {blocked, step};
  };
  const auto [queued_blocked, queued_step] = run(int64_t{256} << 20);
  const auto [sync_blocked, sync_step] = run(1);
  RecordProperty("queued_blocked_fraction", std::to_string(queued_blocked / queued_step));
  RecordProperty("one_byte_queue_blocked_fraction", std::to_string(sync_blocked / sync_step));
  EXPECT_LT(queued_blocked, 0.01 * queued_step) << "blocked " << queued_blocked << " s of " << queued_step << " s";
  EXPECT_GT(sync_blocked, 0.2 * sync_step) << "blocked " << sync_blocked << " s of " << sync_step << " s";
}

TEST_F(PipelineTest, AnAssignmentWithABadDepthOrQueueIsRefusedNamingTheField) {
  std::string job = Job("job", 1);
  fs::path apath = dir_ / "bad.json";
  for (const char* field :
       {"\"in_flight\": -1", "\"in_flight\": \"deep\"", "\"send_queue_bytes\": 0", "\"recompute\": 1"}) {
    std::ofstream(apath) << "{\"stage\": 0, \"num_stages\": 1, \"first_op\": 0, \"last_op\": 5, " << field << "}";
    Process p(Bin("meridian-executor") + " --site a --certs " + (dir_ / "certs" / "bundles" / "a").string() +
              " --listen 127.0.0.1:" + std::to_string(FreePort()) + " --assignment " + apath.string() + " --job " +
              job + " 2>&1");
    std::string out = p.ReadAll(60s);
    EXPECT_EQ(p.Wait(30s), 2) << out;
    EXPECT_THAT(out, HasSubstr(std::string(field).substr(1, std::string(field).find('"', 1) - 1))) << out;
    EXPECT_THAT(out, HasSubstr(apath.string()));
  }
}

// job.step_overlap (#17): each step's first K micro-batches run on the weights of the step before, their
// forward passes begun in the previous step's drain (partitioner::OverlappedStepSchedule). One, two and
// three stages, a deeper and recomputing stage and replicas train exactly what `meridian train-local`
// trains with the same job (the early micro-batches on a copy of the previous step's weights), which is
// not what the exact job trains. A depth the overlap cannot hold is refused naming the field.
TEST_F(PipelineTest, StepOverlapMatchesTheSingleProcessTrainerWithTheSameOverlap) {
  const std::string exact = Job("exact", 6), job = Job("overlap", 6);
  // Step 4 follows a checkpoint step: exact, as train-local has it too.
  std::ofstream(job, std::ios::app) << "  step_overlap: 2\n  checkpoint: {interval: 3, dir: ckpt}\n";
  std::vector<double> ref_losses, exact_losses, losses;
  auto want = Reference(job, &ref_losses);
  auto exact_want = Reference(exact, &exact_losses, "local-exact");
  ASSERT_EQ(ref_losses.size(), 6u);
  ASSERT_EQ(exact_losses.size(), 6u);
  EXPECT_DOUBLE_EQ(ref_losses[0], exact_losses[0]);  // the first step is exact
  EXPECT_NE(ref_losses[1], exact_losses[1]);         // the second's first two micro-batches are not
  double most = 0;
  for (const auto& [name, t] : want) most = std::max(most, testing::RelativeL2(t, exact_want.at(name)));
  EXPECT_GT(most, 1e-4) << "the overlap changed nothing";
  ExpectClose(Distributed(job, {{0, 5}}, "identity", "identity", &losses), want);
  ASSERT_EQ(losses.size(), 6u);
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(losses[i], ref_losses[i], 1e-5 * ref_losses[i]) << "step " << i + 1;
  const fs::path trace = dir_ / "trace";
  fs::create_directories(trace);
  ::setenv("MERIDIAN_TRACE_DIR", trace.string().c_str(), 1);
  ExpectClose(Distributed(job, {{0, 2}, {3, 5}}, "identity", "identity", &losses), want);
  ::unsetenv("MERIDIAN_TRACE_DIR");
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(losses[i], ref_losses[i], 1e-5 * ref_losses[i]) << "step " << i + 1;
  // Stage 0's forward passes per step: the next step's first two (numbered 4 and 5 in its timeline) in
  // steps 1, 2, 4 and 5, whose next steps begin early; none of its own early ones in steps 2, 3, 5, 6.
  std::ifstream in(trace / "trace-a-stage0.jsonl");
  std::vector<std::vector<int>> forwards;
  for (std::string line; std::getline(in, line);) {
    forwards.emplace_back();
    const auto j = nlohmann::json::parse(line);
    for (const auto& iv : j["intervals"])
      if (iv[0] == "F") forwards.back().push_back(iv[1].get<int>());
  }
  EXPECT_EQ(forwards, (std::vector<std::vector<int>>{
                          {0, 1, 2, 3, 4, 5}, {2, 3, 4, 5}, {2, 3}, {0, 1, 2, 3, 4, 5}, {2, 3, 4, 5}, {2, 3}}));
  ExpectClose(Distributed(job, {{0, 1}, {2, 3}, {4, 5}}, "identity", "identity", nullptr), want);
  ExpectClose(Distributed(job, {{0, 2, {}, 3, true}, {3, 5, {}, 1}}, "identity", "identity", nullptr), want);
  ExpectClose(Distributed(job, {{0, 2, {2, 2}}, {3, 5}}, "identity", "identity", nullptr), want);
  ExpectClose(Distributed(job, {{0, 2}, {3, 5, {3, 1}}}, "identity", "identity", nullptr), want);

  // Three in flight is the most with 4 micro-batches and 2 early ones.
  const fs::path apath = dir_ / "deep.json";
  std::ofstream(apath) << "{\"stage\": 0, \"num_stages\": 2, \"first_op\": 0, \"last_op\": 2, \"in_flight\": 4, "
                          "\"next_site\": \"b\", \"next_address\": \"127.0.0.1:"
                       << FreePort() << "\"}";
  Process p(Bin("meridian-executor") + " --site a --certs " + (dir_ / "certs" / "bundles" / "a").string() +
            " --listen 127.0.0.1:" + std::to_string(FreePort()) + " --assignment " + apath.string() + " --job " + job +
            " 2>&1");
  const std::string out = p.ReadAll(60s);
  EXPECT_NE(p.Wait(30s), 0) << out;
  EXPECT_THAT(out, HasSubstr("job.step_overlap 2 with 4 micro-batches a step allows at most 3 in flight")) << out;
}

// AQ-SGD inside the pipeline: instruction data small enough that every sequence comes back every few
// steps (as fine-tuning epochs do), three stages whose activations go as int4 or int2 deltas against each
// sequence's previous activation (int8 on a first visit) and whose gradients go as int4. Over 200 steps
// the loss stays within 2% of the identity run's (mean of the last 20 steps: one step is 4 sequences),
// while stage 0 sends several times fewer bytes than identity.
TEST_F(PipelineTest, ActivationDeltasTrainWithinTwoPercentOfIdentity) {
  {  // plain text: sentences of a small grammar, about 70 sequences of 32 tokens, seen every 9 steps
    std::ofstream text(dir_ / "text.txt");
    std::mt19937 rng(11);
    const char* verbs[] = {"likes", "sees", "helps", "finds", "meets", "calls"};
    for (int i = 0; i < 300; ++i)
      text << "word" << rng() % 40 << " " << verbs[rng() % 6] << " word" << rng() % 40 << " and word" << rng() % 40
           << ".\n";
  }
  ASSERT_NO_FATAL_FAILURE(
      TextModel(dir_ / "text.txt", 300,
                R"({"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": false})"));
  const int steps = 200;
  const std::string job = (dir_ / "ft.yaml").string();
  std::ofstream(job) << "job:\n  model: model\n  data: text.txt\n  steps: " << steps
                     << "\n  global_batch: 8\n  micro_batches: 4\n  sequence_length: 32\n  seed: 5\n"
                        "  optimizer: {name: adamw, lr: 0.003, warmup_steps: 5, grad_clip: 1.0}\n"
                        "  compression: {policy: fixed, activation_memory: 1MiB}\n";
  const std::vector<Stage> stages = {{0, 1}, {2, 3}, {4, 5}};
  auto sent = [](const std::string& log) {  // stage 0's wire and raw bytes
    std::smatch m;
    EXPECT_TRUE(std::regex_search(log, m, std::regex("wire bytes (\\d+) raw bytes (\\d+)"))) << log;
    return m.size() == 3 ? std::stod(m[1]) / std::stod(m[2]) : 1.0;
  };
  std::vector<double> exact, int4, int2;
  std::string log;
  Distributed(job, stages, "identity", "identity", &exact);
  Distributed(job, stages, "int4-delta", "int4", &int4, "", &log);
  const double int4_ratio = sent(log);
  Distributed(job, stages, "int2-delta", "int4", &int2, "", &log);
  const double int2_ratio = sent(log);
  std::vector<double> plain4;
  Distributed(job, stages, "int4", "int4", &plain4);
  RecordProperty("int4_tail_loss", std::to_string(TailMean(plain4, 20)));
  ASSERT_EQ(exact.size(), static_cast<size_t>(steps));
  ASSERT_EQ(int4.size(), static_cast<size_t>(steps));
  ASSERT_EQ(int2.size(), static_cast<size_t>(steps));
  const double e = TailMean(exact, 20), d4 = TailMean(int4, 20), d2 = TailMean(int2, 20);
  RecordProperty("identity_tail_loss", std::to_string(e));
  RecordProperty("int4_delta_tail_loss", std::to_string(d4));
  RecordProperty("int2_delta_tail_loss", std::to_string(d2));
  RecordProperty("int4_delta_wire_fraction", std::to_string(int4_ratio));
  RecordProperty("int2_delta_wire_fraction", std::to_string(int2_ratio));
  EXPECT_LT(e, 0.5 * TailMean(std::vector<double>(exact.begin(), exact.begin() + 20), 20));  // it learns
  EXPECT_NEAR(d4, e, 0.02 * e);
  EXPECT_NEAR(d2, e, 0.02 * e);
  // Stage 0 sends activations only: deltas after the first epoch, int8 before it.
  EXPECT_LT(int4_ratio, 0.2);
  EXPECT_LT(int2_ratio, 0.125);
}

// Text data end to end: a SentencePiece tokenizer (meridian tokenizer train), brief pre-training on plain
// text whose output is an HF model directory, then instruction fine-tuning from those weights with the
// loss on response tokens only: two executors equal the single-process trainer, and `meridian eval`
// scores the held-out split.
TEST_F(PipelineTest, InstructionFineTuningFromPretrainedWeightsMatchesTheSingleProcessTrainer) {
  std::ofstream(dir_ / "text.txt") << "the quick brown fox jumps over the lazy dog\n\nopposites of hot and cold\n";
  {
    std::ofstream words(dir_ / "words.txt");
    for (int i = 0; i < 50; ++i) words << "word" << i << " the opposite of hot is cold, of big small\n";
  }
  {
    std::ofstream jsonl(dir_ / "inst.jsonl");
    for (int i = 0; i < 40; ++i)
      jsonl << "{\"prompt\": \"opposite of word" << i << " =>\", \"response\": \"word" << (i + 1) % 40
            << "\", \"kind\": \"" << (i % 2 ? "odd" : "even") << "\"}\n";
  }
  ASSERT_NO_FATAL_FAILURE(
      TextModel(dir_ / "words.txt", 400,
                R"({"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": false})"));
  const std::string opt = "\n  optimizer: {name: adamw, lr: 0.01, warmup_steps: 1, grad_clip: 0.5}\n";
  std::ofstream(dir_ / "pre.yaml") << "job:\n  model: model\n  data: text.txt\n  steps: 2\n  global_batch: 2\n"
                                      "  micro_batches: 1\n  sequence_length: 16\n  seed: 3"
                                   << opt;
  Process pre(Bin("meridian") + " train-local " + (dir_ / "pre.yaml").string() + " --out " + (dir_ / "base").string() +
              " 2>&1");
  std::string pre_out = pre.ReadAll(120s);
  ASSERT_EQ(pre.Wait(60s), 0) << pre_out;
  for (const char* f : {"model.safetensors", "config.json", "tokenizer.model"})
    ASSERT_TRUE(fs::exists(dir_ / "base" / f)) << f;

  const std::string job = (dir_ / "ft.yaml").string();
  std::ofstream(job) << "job:\n  model: base\n  data: inst.jsonl\n  eval_fraction: 0.1\n  steps: 3\n"
                        "  global_batch: 4\n  micro_batches: 2\n  sequence_length: 16\n  seed: 5"
                     << opt << "  compression: {policy: fixed, activations: identity, gradients: identity}\n"
                     << "  checkpoint: {interval: 1, keep: 5}\n";
  std::vector<double> ref_losses, dist_losses;
  auto want = Reference(job, &ref_losses);
  ASSERT_EQ(ref_losses.size(), 3u);
  // Training starts from the pre-trained weights, not the seeded initialisation: the same job on the
  // weightless directory (config and tokenizer only) starts from another loss.
  std::string seeded = job;
  seeded.replace(seeded.find("ft.yaml"), 7, "ft-seeded.yaml");
  {
    std::ifstream in(job);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    text.replace(text.find("model: base"), 11, "model: model");
    std::ofstream(seeded) << text;
  }
  std::vector<double> seeded_losses;
  Reference(seeded, &seeded_losses, "local-seeded");
  ASSERT_EQ(seeded_losses.size(), 3u);
  EXPECT_GT(std::abs(seeded_losses[0] - ref_losses[0]), 1e-3 * ref_losses[0]);
  ExpectClose(Distributed(job, {{0, 2}, {3, 5}}, "identity", "identity", &dist_losses), want);
  ASSERT_EQ(dist_losses.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(dist_losses[i], ref_losses[i], 1e-4 * ref_losses[i]);

  Process ev(Bin("meridian") + " eval " + job + " --weights " + (dir_ / "local").string() + " --json " +
             (dir_ / "eval.json").string() + " 2>&1");
  std::string ev_out = ev.ReadAll(60s);
  ASSERT_EQ(ev.Wait(30s), 0) << ev_out;
  EXPECT_NE(ev_out.find("on held-out examples"), std::string::npos) << ev_out;
  auto j = partitioner_json::Load((dir_ / "eval.json").string());
  EXPECT_EQ(j["examples"], 4);  // 10% of 40
  EXPECT_EQ(j["samples"].size(), 4u);
  // Scores per kind of line: every held-out example counted under its kind.
  int by_kind = 0;
  for (const auto& [kind, t] : j["by_kind"].items()) {
    EXPECT_TRUE(kind == "odd" || kind == "even") << kind;
    by_kind += t["examples"].get<int>();
  }
  EXPECT_EQ(by_kind, 4);
  for (const auto& sample : j["samples"]) EXPECT_TRUE(sample["kind"] == "odd" || sample["kind"] == "even") << sample;

  // A finished run scored as `meridian run` does at its end (`meridian eval --run`): the initial model,
  // each checkpoint kept below the last step (the executors wrote steps 1, 2 and 3 into the job's
  // checkpoint directory), and the trained weights.
  fs::create_directories(dir_ / "run" / "weights");
  for (const auto& e : fs::directory_iterator(dir_ / "dist2"))
    if (e.path().extension() == ".safetensors") fs::copy_file(e.path(), dir_ / "run" / "weights" / e.path().filename());
  // `meridian eval --run` of dir_/run: its output (the command must succeed) and RUN/eval.json.
  auto score_run = [&](std::string* out) {
    Process p(Bin("meridian") + " eval " + job + " --run " + (dir_ / "run").string() + " 2>&1");
    *out = p.ReadAll(120s);
    EXPECT_EQ(p.Wait(30s), 0) << *out;
    return partitioner_json::Load((dir_ / "run" / "eval.json").string());
  };
  std::string rev_out;
  auto run_eval = score_run(&rev_out);
  EXPECT_THAT(rev_out, HasSubstr("held-out exact match:"));
  EXPECT_THAT(rev_out, HasSubstr("during training: step 0 "));
  ASSERT_EQ(run_eval["curve"].size(), 4u) << run_eval["curve"];
  for (int i = 0; i < 4; ++i) EXPECT_EQ(run_eval["curve"][i]["step"], i);
  EXPECT_EQ(run_eval["curve"][0]["accuracy"], run_eval["accuracy_before"]);
  EXPECT_EQ(run_eval["curve"][3]["accuracy"], run_eval["accuracy_after"]);
  EXPECT_EQ(run_eval["samples_before"].size(), 4u);
  ASSERT_EQ(run_eval["samples"].size(), 4u);
  for (const char* key : {"by_kind_before", "by_kind_after"}) {
    int n = 0;
    for (const auto& [kind, t] : run_eval[key].items()) n += t["examples"].get<int>();
    EXPECT_EQ(n, 4) << key;
  }
  // The run's two stage shards, merged, generate what train-local's weights of the same job (dir_/local,
  // equal within 1e-5) generate.
  for (int i = 0; i < 4; ++i) EXPECT_EQ(run_eval["samples"][i]["generated"], j["samples"][i]["generated"]) << i;

  // Only this run's intact checkpoints count. With RUN/metrics.jsonl saying when training began, a
  // checkpoint written an hour before (another run's, in a shared directory) is left out; so is one whose
  // shard no longer matches its SHA-256. Each is named, and the run's evaluation still succeeds.
  std::ofstream(dir_ / "run" / "metrics.jsonl") << "{\"step\": 3, \"elapsed_seconds\": 600.0, \"loss\": 1.0}\n";
  fs::last_write_time(dir_ / "checkpoints" / "step-1" / "stage-0.json",
                      fs::file_time_type::clock::now() - std::chrono::hours(1));
  {
    std::fstream shard(dir_ / "checkpoints" / "step-2" / "stage-1.safetensors", std::ios::in | std::ios::out);
    shard.seekp(-4, std::ios::end);
    shard.write("XXXX", 4);
  }
  std::string rev2_out;
  auto run_eval2 = score_run(&rev2_out);
  EXPECT_THAT(rev2_out, HasSubstr("step-1: written before this run's training began"));
  EXPECT_THAT(rev2_out, ContainsRegex("checkpoint not scored: .*step-2"));
  ASSERT_EQ(run_eval2["curve"].size(), 2u) << run_eval2["curve"];
  EXPECT_EQ(run_eval2["curve"][1]["step"], 3);
  EXPECT_EQ(run_eval2["accuracy_after"], run_eval["accuracy_after"]);

  // LoRA on the same job: `meridian eval` of the PEFT adapter (applied to the job's base) generates what
  // the merged export generates; an adapter given to a job without job.lora is refused naming it.
  const std::string lora_job = (dir_ / "ft-lora.yaml").string();
  {
    std::ifstream in(job);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream(lora_job) << text << "  lora: {r: 4, alpha: 16, target_modules: [q_proj, v_proj, up_proj]}\n";
  }
  Process lt(Bin("meridian") + " train-local " + lora_job + " --steps 3 --out " + (dir_ / "lora").string() + " 2>&1");
  std::string lt_out = lt.ReadAll(120s);
  ASSERT_EQ(lt.Wait(60s), 0) << lt_out;
  auto eval_json = [&](const std::string& job_path, const std::string& weights, const std::string& out) {
    Process e(Bin("meridian") + " eval " + job_path + " --weights " + weights + " --json " + out + " 2>&1");
    std::string text = e.ReadAll(60s);
    EXPECT_EQ(e.Wait(30s), 0) << text;
    return partitioner_json::Load(out);
  };
  auto with_adapter = eval_json(lora_job, (dir_ / "lora" / "adapter").string(), (dir_ / "eval-adapter.json").string());
  auto with_merged = eval_json(job, (dir_ / "lora").string(), (dir_ / "eval-merged.json").string());
  ASSERT_EQ(with_adapter["samples"].size(), 4u);
  ASSERT_EQ(with_merged["samples"].size(), 4u);
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(with_adapter["samples"][i]["generated"], with_merged["samples"][i]["generated"]) << i;
  Process bad(Bin("meridian") + " eval " + job + " --weights " + (dir_ / "lora" / "adapter").string() + " 2>&1");
  std::string bad_out = bad.ReadAll(60s);
  EXPECT_EQ(bad.Wait(30s), 2);
  EXPECT_THAT(bad_out, HasSubstr("PEFT adapter but the job has no job.lora"));
}

// The same job with a tokenizer whose vocabulary exceeds the model's, or data that does not parse: the
// error names the file and field.
TEST_F(PipelineTest, BadTextJobsFailNamingTheFileAndField) {
  std::ofstream(dir_ / "bad.jsonl") << "{\"prompt\": \"a\"}\n";
  std::ofstream(dir_ / "bad.yaml") << "job:\n  model: model\n  data: bad.jsonl\n  tokenizer: nope.model\n";
  Process p(Bin("meridian") + " train-local " + (dir_ / "bad.yaml").string() + " --out " + (dir_ / "x").string() +
            " 2>&1");
  std::string out = p.ReadAll(60s);
  EXPECT_EQ(p.Wait(30s), 2);
  EXPECT_NE(out.find("job.tokenizer"), std::string::npos) << out;
  EXPECT_NE(out.find("nope.model"), std::string::npos) << out;
}

// LoRA across 3 executors -- the first holds only the embedding, so no adapter, and only receives its
// gradients -- with adapter dropout: the adapters equal the single-process trainer's; the base weights
// stay as they were; the export holds the merged model and the adapter in PEFT's layout, the same from
// `meridian export` of the run's shards as from train-local.
TEST_F(PipelineTest, LoraAdaptersAcrossExecutorsMatchTheSingleProcessTrainerAndExportInPeftLayout) {
  Reference(Job("pre", 1));  // a "pre-trained" base model: one full step from the seeded initialisation
  fs::rename(dir_ / "local", dir_ / "base");
  std::string job = Job("lora", 3);
  {
    std::ifstream in(job);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    text.replace(text.find("model: model"), 12, "model: base");
    std::ofstream(job) << text
                       << "  lora: {r: 4, alpha: 8, dropout: 0.1, target_modules: [q_proj, v_proj, down_proj]}\n";
  }
  std::vector<double> ref_losses, dist_losses;
  auto merged = Reference(job, &ref_losses);
  ASSERT_EQ(ref_losses.size(), 3u);
  auto adapter = core::ReadSafetensors((dir_ / "local" / "adapter" / "adapter_model.safetensors").string());
  ASSERT_TRUE(adapter.ok()) << adapter.status();
  std::map<std::string, core::Tensor> want;
  for (const auto& [key, t] : adapter->tensors) {
    ASSERT_EQ(key.rfind("base_model.model.model.layers.", 0), 0u) << key;  // PEFT's key names
    want[key.substr(std::string("base_model.model.").size())] = t;
  }
  EXPECT_EQ(want.size(), 12u);  // A and B for 3 projections x 2 layers
  auto config = partitioner_json::Load((dir_ / "local" / "adapter" / "adapter_config.json").string());
  EXPECT_EQ(config["peft_type"], "LORA");
  EXPECT_EQ(config["task_type"], "CAUSAL_LM");
  EXPECT_EQ(config["r"], 4);
  EXPECT_EQ(config["lora_alpha"], 8.0);
  EXPECT_EQ(config["target_modules"], nlohmann::json({"q_proj", "v_proj", "down_proj"}));

  ExpectClose(Distributed(job, {{0, 0}, {1, 2}, {3, 5}}, "identity", "identity", &dist_losses), want);
  ASSERT_EQ(dist_losses.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(dist_losses[i], ref_losses[i], 1e-4 * ref_losses[i]);

  // The merged model: the base where no adapter is, the base plus the update on the target projections.
  auto base = core::ReadSafetensors((dir_ / "base" / "model.safetensors").string());
  ASSERT_TRUE(base.ok()) << base.status();
  ASSERT_EQ(merged.size(), base->tensors.size());
  for (const auto& [name, t] : base->tensors) {
    ASSERT_TRUE(merged.count(name)) << name;
    const bool target = name.find("q_proj") != std::string::npos || name.find("v_proj") != std::string::npos ||
                        name.find("down_proj") != std::string::npos;
    if (target)
      EXPECT_GT(testing::RelativeL2(merged.at(name), t), 1e-6) << name;
    else
      EXPECT_EQ(merged.at(name).bytes, t.bytes) << name;
  }

  // `meridian export` of the run's stage shards writes the same model and adapter.
  Process ex(Bin("meridian") + " export " + job + " --weights " + (dir_ / "dist3").string() + " --out " +
             (dir_ / "exported").string() + " 2>&1");
  std::string ex_out = ex.ReadAll(60s);
  ASSERT_EQ(ex.Wait(30s), 0) << ex_out;
  auto exported = core::ReadSafetensors((dir_ / "exported" / "model.safetensors").string());
  ASSERT_TRUE(exported.ok()) << exported.status();
  ExpectClose(exported->tensors, merged);
  EXPECT_TRUE(fs::exists(dir_ / "exported" / "adapter" / "adapter_model.safetensors"));
  EXPECT_TRUE(fs::exists(dir_ / "exported" / "config.json"));

  // Replicated stages (a+b run layer 0, c+d layer 1, each pair sharing the micro-batches 2/2 and 3/1):
  // the same adapters, and the replicas exchange only adapter gradients -- with two replicas each sends
  // exactly its stage's adapter bytes per step (the other's half of every bucket, then its own half summed).
  std::vector<std::string> logs;
  ExpectClose(Distributed(job, {{0, 2, {2, 2}}, {3, 5, {3, 1}}}, "identity", "identity", nullptr, "", nullptr,
                          "identity", &logs),
              want);
  ASSERT_EQ(logs.size(), 4u);
  int64_t adapter_bytes[2] = {0, 0};
  for (const auto& [name, t] : want)
    adapter_bytes[name.find("layers.0.") != std::string::npos ? 0 : 1] += t.bytes.size();
  for (int i = 0; i < 4; ++i) {
    std::smatch m;
    ASSERT_TRUE(std::regex_search(logs[i], m, std::regex("replica sync wire bytes (\\d+) raw bytes (\\d+)")))
        << logs[i];
    EXPECT_EQ(std::stoll(m[2]), 3 * adapter_bytes[i / 2]) << "site "
                                                          << "abcd"[i];
  }
  // Recomputing stages draw the same adapter dropout masks the second time: the same adapters.
  ExpectClose(Distributed(job, {{0, 0, {}, 0, true}, {1, 2, {}, 0, true}, {3, 5}}, "identity", "identity", nullptr),
              want);
}

// Stage replicas (data parallel across sites) train exactly what one site does: a replicated pipeline
// stage, replicated first and last stages with uneven shares, and plain data parallelism (one stage on
// two sites). The replicas' gradient sums must also keep them identical, or later steps would differ.
TEST_F(PipelineTest, ReplicatedStagesMatchTheSingleProcessTrainer) {
  std::string job = Job("job", 4);
  std::vector<double> ref_losses, losses;
  auto want = Reference(job, &ref_losses);
  ExpectClose(Distributed(job, {{0, 5, {1, 3}}}, "identity", "identity", &losses), want);
  ASSERT_EQ(losses.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(losses[i], ref_losses[i], 1e-5 * ref_losses[i]);
  ExpectClose(Distributed(job, {{0, 1}, {2, 3, {2, 2}}, {4, 5}}, "identity", "identity", nullptr), want);
  std::vector<std::string> logs;
  ExpectClose(Distributed(job, {{0, 2, {3, 1}}, {3, 5, {2, 2}}}, "identity", "identity", &losses, "", nullptr,
                          "identity", &logs),
              want);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(losses[i], ref_losses[i], 1e-5 * ref_losses[i]);
  // The second replica of stage 0 printed the same losses: it received them with the gradient norm.
  EXPECT_EQ(Losses(logs[1]), losses);
  // A site that runs no micro-batch still takes part (its gradients are zeros).
  ExpectClose(Distributed(job, {{0, 2}, {3, 5, {4, 0}}}, "identity", "identity", nullptr), want);
  // Small buckets: most are complete, and sent, while the replica's last backward pass still runs.
  assignment_extra_ = ", \"bucket_bytes\": 4096";
  logs.clear();
  ExpectClose(Distributed(job, {{0, 5, {2, 2}}}, "identity", "identity", nullptr, "", nullptr, "identity", &logs),
              want);
  for (const auto& log : logs) {
    std::smatch m;
    ASSERT_TRUE(std::regex_search(log, m, std::regex("buckets (\\d+) sent during backward (\\d+)"))) << log;
    const int64_t buckets = std::stoll(m[1]), overlapped = std::stoll(m[2]);
    EXPECT_GE(buckets, 4 * 10);  // 4 steps, the 21 tensors (about 60 KB) in 4 KB buckets
    EXPECT_GE(overlapped, buckets - 4 * 2) << "only the last buckets of each step may wait for Finish";
  }
}

// DiLoCo among a stage's replicas (#17): with H = 1, inner SGD, outer SGD at lr 1 without momentum and the
// identity codec, the outer exchange of weighted pseudo-gradients equals every-step gradient averaging,
// so the run equals the single-process trainer (also with uneven micro-batch shares and fragments).
TEST_F(PipelineTest, DilocoWithOneInnerStepEqualsEveryStepAveraging) {
  const std::string job = (dir_ / "diloco.yaml").string();
  auto write = [&](int inner_steps, int fragments, const char* outer, bool overlap = false, int steps = 4,
                   const char* codec = "identity") {
    std::ofstream(job) << "job:\n  model: model\n  data: synthetic\n  steps: " << steps
                       << "\n  global_batch: 4\n"
                          "  micro_batches: 4\n  sequence_length: 16\n  seed: 7\n"
                          "  optimizer: {name: sgd, lr: 0.5, warmup_steps: 0, grad_clip: 0}\n"
                          "  compression: {policy: none}\n"
                          "  sync:\n    mode: diloco\n    inner_steps: "
                       << inner_steps << "\n    fragments: " << fragments << "\n    codec: " << codec
                       << "\n    overlap: " << (overlap ? "true" : "false") << "\n"
                       << "    outer_optimizer: " << outer << "\n";
  };
  write(1, 1, "{name: sgd, lr: 1, momentum: 0}");
  std::vector<double> ref_losses, losses;
  auto want = Reference(job, &ref_losses);
  std::vector<std::string> logs;
  ExpectClose(Distributed(job, {{0, 5, {1, 3}}}, "identity", "identity", &losses, "", nullptr, "identity", &logs),
              want);
  ASSERT_EQ(losses.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(losses[i], ref_losses[i], 1e-5 * ref_losses[i]);
  for (const auto& log : logs) EXPECT_THAT(log, HasSubstr("outer sync of fragment 0 after step 4"));
  // Whole-model workers wait for no one between syncs: the second received no total and printed its own
  // share of each step's loss (3 of the 4 micro-batches), which replica 0 added to its own.
  ASSERT_EQ(logs.size(), 2u);
  const std::vector<double> share = Losses(logs[1]);
  ASSERT_EQ(share.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_GT(share[i], 0.5 * losses[i]);
    EXPECT_LT(share[i], 0.9 * losses[i]);
  }
  ExpectClose(Distributed(job, {{0, 1}, {2, 3, {2, 2}}, {4, 5}}, "identity", "identity", nullptr), want);
  // Two whole pipelines of two stages (a -> c with one micro-batch, b -> d with three), each an independent
  // worker between syncs: the same weights, and stage 0's replica 1 printed its pipeline's share of each
  // step's loss, not the total (the pipelines exchanged no norm).
  assignment_extra_ = ", \"whole_pipelines\": true";
  logs.clear();
  ExpectClose(Distributed(job, {{0, 2, {1, 3}}, {3, 5, {1, 3}}}, "identity", "identity", &losses, "", nullptr,
                          "identity", &logs),
              want);
  assignment_extra_.clear();
  ASSERT_EQ(losses.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(losses[i], ref_losses[i], 1e-5 * ref_losses[i]);
  ASSERT_EQ(logs.size(), 4u);
  const std::vector<double> pipeline_share = Losses(logs[1]);
  ASSERT_EQ(pipeline_share.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_GT(pipeline_share[i], 0.5 * losses[i]);
    EXPECT_LT(pipeline_share[i], 0.9 * losses[i]);
  }
  // Fragments each synchronised every inner step (H = F = 2 with H / F = 1: fragment 0, then 1, ...) are not
  // one averaging per step; H = 2 is not either. Both still train, and the replicas agree after each sync.
  write(2, 2, "{name: nesterov, lr: 0.7, momentum: 0.9}");
  logs.clear();
  Distributed(job, {{0, 5, {2, 2}}}, "identity", "identity", &losses, "", nullptr, "identity", &logs);
  ASSERT_EQ(losses.size(), 4u);
  EXPECT_LT(losses.back(), losses.front());
  for (const auto& log : logs) {
    EXPECT_THAT(log, HasSubstr("outer sync of fragment 1 after step 1"));
    EXPECT_THAT(log, HasSubstr("outer sync of fragment 0 after step 2"));
  }
  // Overlapped (the default), int4 with error feedback: each exchange is applied two steps after it began,
  // and the last step synchronises once more without overlap.
  write(2, 1, "{name: nesterov, lr: 0.7, momentum: 0.9}", true, 6, "int4");
  logs.clear();
  Distributed(job, {{0, 5, {3, 1}}}, "identity", "identity", &losses, "", nullptr, "identity", &logs);
  ASSERT_EQ(losses.size(), 6u);
  EXPECT_LT(losses.back(), losses.front());
  for (const auto& log : logs) {
    EXPECT_THAT(log, HasSubstr("outer sync of fragment 0 after step 2"));  // applied after step 4
    EXPECT_THAT(log, HasSubstr("outer sync of fragment 0 after step 6"));
  }
}

// Lossy replica gradient sums stay close to the exact loss: int8 activations and gradients on the
// pipeline link with int8 replica sums (the strongest codec of the planner's gradient menu) over 30 steps.
TEST_F(PipelineTest, CompressedReplicaGradientsStayWithinTwoPercentOfTheIdentityLoss) {
  std::string job = Job("job", 30);
  std::vector<double> exact, int8;
  Distributed(job, {{0, 2, {2, 2}}, {3, 5, {2, 2}}}, "identity", "identity", &exact);
  Distributed(job, {{0, 2, {2, 2}}, {3, 5, {2, 2}}}, "int8", "int8", &int8, "", nullptr, "int8");
  ASSERT_EQ(exact.size(), 30u);
  ASSERT_EQ(int8.size(), 30u);
  EXPECT_LT(exact.back(), exact.front());  // it trains
  EXPECT_NEAR(int8.back(), exact.back(), 0.02 * exact.back());
}

// int8 activations, int8 activation gradients and top-k (10%) replica gradient sums with error feedback
// (two replicated stages, 2/2 shares): over 200 steps the loss stays within 2% of the identity run; the
// same run without error feedback does not (measured with the last 20 steps' mean loss, seeds 7-10:
// error feedback -0.7%..+0.4%, without it +3.1%/+4.2% for seeds 7/8). Error feedback pays back what
// top-k delays, so early on it lags: +7% after 30 steps, measured and documented in docs/cost-model.md.
TEST_F(PipelineTest, TopkReplicaGradientsWithErrorFeedbackStayWithinTwoPercentOfTheIdentityLoss) {
  const int steps = 200;
  std::string job = Job("job", steps);
  const std::vector<Stage> stages = {{0, 2, {2, 2}}, {3, 5, {2, 2}}};
  std::vector<double> exact, topk, topk_without_feedback;
  Distributed(job, stages, "identity", "identity", &exact);
  Distributed(job, stages, "int8", "int8", &topk, "", nullptr, "topk:k=0.1");
  ASSERT_EQ(exact.size(), static_cast<size_t>(steps));
  ASSERT_EQ(topk.size(), static_cast<size_t>(steps));
  EXPECT_LT(TailMean(exact, 20), 0.5 * exact.front());  // it trains
  EXPECT_NEAR(TailMean(topk, 20), TailMean(exact, 20), 0.02 * TailMean(exact, 20));
  // The comparison can fail: without error feedback top-k's dropped mass is lost for good.
  std::string no_feedback = Job("no_feedback", steps);
  std::ifstream in(no_feedback);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  text.replace(text.find("compression: {"), 14, "compression: {error_feedback: false, ");
  std::ofstream(no_feedback) << text;
  Distributed(no_feedback, stages, "int8", "int8", &topk_without_feedback, "", nullptr, "topk:k=0.1");
  EXPECT_GT(TailMean(topk_without_feedback, 20), 1.02 * TailMean(exact, 20));
}

// Two pipelines of two stages (4 processes; each stage's two replicas take 2 of the 4 micro-batches, so
// micro-batch m runs through the same pipeline at both stages), synchronised by DiLoCo every 20 inner steps
// (Nesterov at lr 0.7 with momentum 0.5, int4 pseudo-gradients with error feedback, overlapped) against
// every-step gradient sums: the mean loss of the last 20 of 400 steps, at equal tokens, within 2% (#17).
// (The paper's momentum 0.9 misses here: +12% without overlap, +45% with it; docs/sync.md has the table.)
TEST_F(PipelineTest, TwoDilocoPipelinesTrainWithinTwoPercentOfEveryStepAveraging) {
  const int steps = 400;
  const std::vector<Stage> stages = {{0, 2, {2, 2}}, {3, 5, {2, 2}}};
  std::vector<double> every, diloco;
  std::vector<std::string> logs;
  Distributed(Job("every", steps), stages, "identity", "identity", &every);
  const std::string job = Job("diloco", steps);
  std::ofstream(job, std::ios::app)
      << "  sync: {mode: diloco, inner_steps: 20, codec: int4, outer_optimizer: {name: nesterov, lr: 0.7, momentum: "
         "0.5}}\n";
  assignment_extra_ = ", \"whole_pipelines\": true";  // as the coordinator assigns this plan: each its own norm
  Distributed(job, stages, "identity", "identity", &diloco, "", nullptr, "identity", &logs);
  assignment_extra_.clear();
  ASSERT_EQ(every.size(), static_cast<size_t>(steps));
  ASSERT_EQ(diloco.size(), static_cast<size_t>(steps));
  EXPECT_LT(TailMean(every, 20), 0.5 * every.front());  // it trains
  std::cout << "every step " << TailMean(every, 20) << ", DiLoCo H = 20 " << TailMean(diloco, 20) << "\n";
  EXPECT_NEAR(TailMean(diloco, 20), TailMean(every, 20), 0.02 * TailMean(every, 20));
  // 20 exchanges of int4 pseudo-gradients (and the final one) instead of 400 float32 gradient sums: at
  // least 20 x 7 = 140 times fewer replica bytes (int4 is 0.14 of float32 with its block scales).
  // (19 exchanges after steps 20, 40, ..., 380, and the one after the last step.)
  std::smatch m;
  ASSERT_TRUE(std::regex_search(logs[0], m, std::regex("replica sync wire bytes (\\d+) raw bytes (\\d+)"))) << logs[0];
  const double wire = std::stod(m[1]), exchange_float32 = std::stod(m[2]) / 20;
  std::cout << "replica bytes: " << wire << " on the wire; every step in float32: " << 400 * exchange_float32 << " ("
            << 400 * exchange_float32 / wire << "x)\n";
  EXPECT_GE(400 * exchange_float32 / wire, 130);
}

// SparseLoCo (Sarfi et al. 2025; docs/sync.md) between the same two pipelines at H = 50: each replica sends
// the top 4% of every 4096 values of its pseudo-gradient plus its residual decayed by 0.3 (int8 values with
// their indices) to the other, both add the two sparse vectors, and the outer parameters step by the sum
// (lr 1, no outer momentum). Over 400 steps the last 20 steps' mean loss is within 2% of every-step
// gradient sums at equal tokens, with more than 1,000x fewer replica bytes (#17's stretch goal). Seeds 7,
// 8, 9: +0.9%, -0.2%, +1.9% at 2,220x; int4 with Nesterov (lr 0.7, momentum 0.5) at the same H: +3.1%,
// +1.8%, +5.3% at 348x. Neighbouring settings move a seed's figure by about a point (docs/sync.md).
TEST_F(PipelineTest, SparseLocoPipelinesTrainWithinTwoPercentOfEveryStepWithAThousandTimesFewerBytes) {
  const int steps = 400;
  const std::vector<Stage> stages = {{0, 2, {2, 2}}, {3, 5, {2, 2}}};
  std::vector<double> every, sparse;
  std::vector<std::string> every_logs, logs;
  Distributed(Job("every", steps), stages, "identity", "identity", &every, "", nullptr, "identity", &every_logs);
  const std::string job = Job("sparseloco", steps);
  std::ofstream(job, std::ios::app) << "  sync: {mode: diloco, inner_steps: 50, codec: 'topk-int8:k=0.04:chunk=4096', "
                                       "outer_optimizer: {name: sparseloco, lr: 1, momentum: 0.3}}\n";
  assignment_extra_ = ", \"whole_pipelines\": true";
  Distributed(job, stages, "identity", "identity", &sparse, "", nullptr, "identity", &logs);
  assignment_extra_.clear();
  ASSERT_EQ(every.size(), static_cast<size_t>(steps));
  ASSERT_EQ(sparse.size(), static_cast<size_t>(steps));
  EXPECT_LT(TailMean(every, 20), 0.5 * every.front());  // it trains
  std::cout << "every step " << TailMean(every, 20) << ", SparseLoCo H = 50 " << TailMean(sparse, 20) << "\n";
  EXPECT_NEAR(TailMean(sparse, 20), TailMean(every, 20), 0.02 * TailMean(every, 20));
  // Stage 0's replica 0: every step's float32 gradient sums against 8 sparse exchanges (after steps 50,
  // 100, ..., 350 and the last).
  const std::regex bytes("replica sync wire bytes (\\d+) raw bytes (\\d+)");
  std::smatch e, m;
  ASSERT_TRUE(std::regex_search(every_logs[0], e, bytes)) << every_logs[0];
  ASSERT_TRUE(std::regex_search(logs[0], m, bytes)) << logs[0];
  const double every_wire = std::stod(e[1]), wire = std::stod(m[1]), exchange_float32 = std::stod(m[2]) / 8;
  EXPECT_DOUBLE_EQ(std::stod(e[2]), steps * exchange_float32);  // the same parameters, as float32
  std::cout << "replica bytes: " << wire << " on the wire; every step: " << every_wire << " on the wire, "
            << steps * exchange_float32 << " in float32 (" << steps * exchange_float32 / wire << "x)\n";
  EXPECT_GE(steps * exchange_float32 / wire, 1000);
  EXPECT_GE(every_wire / wire, 1000);
}

// int8 on both directions of the pipeline link. (Top-k on the *activation gradients* of this link misses
// 2%: at k = 10% with error feedback, +4.2%..+9.6% after 200 steps (last 20 steps' mean loss, seeds 7-10)
// and 16% after 30 steps; see docs/executor.md. The adaptive policy never chooses it.)
TEST_F(PipelineTest, Int8LinksStayWithinTwoPercentOfTheIdentityLoss) {
  const int steps = 30;
  std::string job = Job("job", steps);
  std::vector<double> exact, compressed;
  Distributed(job, {{0, 2}, {3, 5}}, "identity", "identity", &exact);
  Distributed(job, {{0, 2}, {3, 5}}, "int8", "int8", &compressed);
  ASSERT_EQ(exact.size(), static_cast<size_t>(steps));
  ASSERT_EQ(compressed.size(), static_cast<size_t>(steps));
  RecordProperty("identity_final_loss", std::to_string(exact.back()));
  RecordProperty("compressed_final_loss", std::to_string(compressed.back()));
  EXPECT_LT(exact.back(), exact.front());  // it learns
  EXPECT_NEAR(compressed.back(), exact.back(), 0.02 * exact.back());
}

// int4, the strongest codec the adaptive policy puts on a pipeline link (both directions), over 30 steps.
// (Measured with the last 20 steps' mean loss after 200 steps: +0.6%.)
TEST_F(PipelineTest, Int4LinksStayWithinTwoPercentOfTheIdentityLoss) {
  const int steps = 30;
  std::string job = Job("job", steps);
  std::vector<double> exact, compressed;
  Distributed(job, {{0, 2}, {3, 5}}, "identity", "identity", &exact);
  Distributed(job, {{0, 2}, {3, 5}}, "int4", "int4", &compressed);
  ASSERT_EQ(exact.size(), static_cast<size_t>(steps));
  ASSERT_EQ(compressed.size(), static_cast<size_t>(steps));
  EXPECT_LT(exact.back(), exact.front());
  EXPECT_NEAR(compressed.back(), exact.back(), 0.02 * exact.back());
}

TEST_F(PipelineTest, ResumeFromTheLastIntactCheckpointOnAnyPartitionMatchesAnUninterruptedRun) {
  std::string job = Job("job", 6);
  std::ofstream(job, std::ios::app) << "  checkpoint: {dir: ckpt, interval: 2}\n";
  auto full = Distributed(job, {{0, 2}, {3, 5}}, "identity", "identity", nullptr);
  for (int step : {2, 4, 6}) {
    EXPECT_TRUE(fs::exists(dir_ / "ckpt" / ("step-" + std::to_string(step)) / "stage-0.json")) << step;
    EXPECT_TRUE(fs::exists(dir_ / "ckpt" / ("step-" + std::to_string(step)) / "stage-1.safetensors")) << step;
  }
  // The newest checkpoint is damaged: a truncated shard. Resuming must use step 4.
  fs::resize_file(dir_ / "ckpt" / "step-6" / "stage-1.safetensors", 100);
  std::string log;
  auto resumed = Distributed(job, {{0, 1}, {2, 3}, {4, 5}}, "identity", "identity", nullptr, "--resume", &log);
  EXPECT_THAT(log, HasSubstr("resuming after step 4"));
  EXPECT_THAT(log, HasSubstr("checksum mismatch"));
  ExpectClose(resumed, full);
}

TEST_F(PipelineTest, ProfilerWritesWhatThePlannerReads) {
  std::string job = Job("job", 1);
  Process p(Bin("meridian-executor") + " --site a --profile " + job + " --out " + (dir_ / "prof").string() + " 2>&1");
  std::string log = p.ReadAll(120s);
  ASSERT_EQ(p.Wait(60s), 0) << log;
  auto graph = partitioner_json::Load((dir_ / "prof" / "graph.json").string());
  auto profile = partitioner_json::Load((dir_ / "prof" / "profile-a.json").string());
  ASSERT_EQ(graph["ops"].size(), 6u);
  EXPECT_EQ(graph["ops"][1]["name"], "layer0.attn");
  auto site = profile["sites"][0];
  EXPECT_EQ(site["name"], "a");
  EXPECT_GT(site["flops_per_second"].get<double>(), 1e8);
  for (const char* op : {"embed", "layer0.attn", "layer0.mlp", "layer1.attn", "layer1.mlp", "head"})
    EXPECT_GT(site["op_seconds"][op].get<double>(), 0.0) << op;
  // The optimizer step per byte of its state is measured (its value is a timing: not compared here).
  EXPECT_GT(site["optimizer_seconds_per_byte"].get<double>(), 0.0);
  Process plan(Bin("meridian") + " plan --graph " + (dir_ / "prof" / "graph.json").string() + " --profile " +
               (dir_ / "prof" / "profile-a.json").string() + " --json");
  std::string out = plan.ReadAll(60s);
  EXPECT_EQ(plan.Wait(30s), 0) << out;
  EXPECT_THAT(out, HasSubstr("predicted_step_seconds"));
  EXPECT_GT(nlohmann::json::parse(out)["optimizer_seconds"].get<double>(), 0.0);
}

TEST_F(PipelineTest, PeerKilledMidRunFailsTheOtherStageNamingIt) {
  std::string job = Job("job", 100000);
  int pa = FreePort(), pb = FreePort();
  std::string a0 = (dir_ / "a0.json").string(), a1 = (dir_ / "a1.json").string();
  std::ofstream(a0)
      << R"({"stage": 0, "num_stages": 2, "first_op": 0, "last_op": 2, "next_site": "b", "next_address": "127.0.0.1:)"
      << pb << "\"}";
  std::ofstream(a1)
      << R"({"stage": 1, "num_stages": 2, "first_op": 3, "last_op": 5, "prev_site": "a", "prev_address": "127.0.0.1:)"
      << pa << "\"}";
  auto run = [&](const char* site, int port, const std::string& a) {
    return std::make_unique<Process>(Bin("meridian-executor") + " --site " + site + " --certs " +
                                     (dir_ / "certs" / "bundles" / site).string() +
                                     " --listen 127.0.0.1:" + std::to_string(port) + " --assignment " + a + " --job " +
                                     job + " --step-timeout 8 2>&1");
  };
  auto pa_proc = run("a", pa, a0);
  auto pb_proc = run("b", pb, a1);
  ASSERT_THAT(pa_proc->ReadLine(60s), HasSubstr("step 0 loss"));
  pb_proc->Kill(SIGKILL);
  auto t0 = std::chrono::steady_clock::now();
  int rc = pa_proc->Wait(30s);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 15s);
  EXPECT_EQ(rc, 1);
  std::string err = pa_proc->ReadAll(5s);
  EXPECT_THAT(err, HasSubstr("stage 0 (site 'a')"));
  EXPECT_THAT(err, HasSubstr("peer 'b'"));
}

// Data parallel on two sites; b dies mid-run: a's step fails within the deadline naming its replica.
TEST_F(PipelineTest, ReplicaKilledMidRunFailsTheOtherReplicaNamingIt) {
  std::string job = Job("job", 100000);
  int pa = FreePort(), pb = FreePort();
  std::string assignment = (dir_ / "dp.json").string();
  std::ofstream(assignment) << R"({"stage": 0, "num_stages": 1, "first_op": 0, "last_op": 5, "replicas": [)"
                            << R"({"site": "a", "address": "127.0.0.1:)" << pa
                            << R"("}, {"site": "b", "address": "127.0.0.1:)" << pb << R"("}]})";
  auto run = [&](const char* site, int port) {
    return std::make_unique<Process>(Bin("meridian-executor") + " --site " + site + " --certs " +
                                     (dir_ / "certs" / "bundles" / site).string() +
                                     " --listen 127.0.0.1:" + std::to_string(port) + " --assignment " + assignment +
                                     " --job " + job + " --step-timeout 8 2>&1");
  };
  auto a = run("a", pa);
  auto b = run("b", pb);
  ASSERT_THAT(a->ReadLine(60s), HasSubstr("step 0 loss"));
  b->Kill(SIGKILL);
  auto t0 = std::chrono::steady_clock::now();
  int rc = a->Wait(30s);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 15s);
  EXPECT_EQ(rc, 1);
  std::string err = a->ReadAll(5s);
  EXPECT_THAT(err, HasSubstr("stage 0 replica 0 (site 'a')"));
  EXPECT_THAT(err, HasSubstr("'b'"));
}

TEST_F(PipelineTest, WrongShapeAndCorruptFramesFailNamingPeerAndStage) {
  std::string job = Job("job", 2);
  struct Case {
    const char* send;    // the tool's frame
    const char* expect;  // in the stage's error
  };
  // The stage expects [1, 16, 32] float32 activations (2 KiB): a frame of another shape within the size
  // such a frame may have, the same frame corrupted, and a frame far larger than it may be (refused as it
  // arrives, before it is buffered).
  for (const Case& c :
       {Case{" --elements 1000", "expected float32"}, Case{" --elements 1000 --corrupt 1", "corrupt frame"},
        Case{" --frame-mib 1", "with frame size 1048640 (at most"}}) {
    int pa = FreePort(), pb = FreePort();
    std::string a1 = (dir_ / "a1.json").string();
    std::ofstream(a1)
        << R"({"job_id": "job", "stage": 1, "num_stages": 2, "first_op": 3, "last_op": 5, "prev_site": "a", "prev_address": "127.0.0.1:)"
        << pa << "\"}";
    // Stage 1's previous site is served by a tool holding site a's identity (so it can connect), and
    // another tool with that identity sends it a bad tensor.
    Process prev(Bin("meridian-peertool") + " serve --certs " + (dir_ / "certs").string() +
                 " --self a --allow b --listen 127.0.0.1:" + std::to_string(pa));
    ASSERT_THAT(prev.ReadLine(10s), HasSubstr("listening"));
    Process stage1(Bin("meridian-executor") + " --site b --certs " + (dir_ / "certs" / "bundles" / "b").string() +
                   " --listen 127.0.0.1:" + std::to_string(pb) + " --assignment " + a1 + " --job " + job +
                   " --step-timeout 20 2>&1");
    std::this_thread::sleep_for(1500ms);
    // Site a's certificate, but a tool that sends a bad tensor where [1, 16, 32] is expected.
    Process fake(Bin("meridian-peertool") + " send --certs " + (dir_ / "certs").string() +
                 " --self a --peer b --address 127.0.0.1:" + std::to_string(pb) + c.send +
                 " --frames 1 --job-id job 2>&1");
    fake.Wait(30s);
    int rc = stage1.Wait(30s);
    std::string err = stage1.ReadAll(5s);
    EXPECT_EQ(rc, 1) << err;
    EXPECT_THAT(err, HasSubstr("stage 1 (site 'b')"));
    EXPECT_THAT(err, HasSubstr("peer 'a'"));
    EXPECT_THAT(err, HasSubstr(c.expect));
  }
}

}  // namespace
}  // namespace meridian
