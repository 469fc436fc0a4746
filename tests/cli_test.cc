// Integration tests of the two binaries, run as real processes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::string Env(const char* k, const char* fallback) {
  const char* v = std::getenv(k);
  return v ? v : fallback;
}
std::string Bin(const std::string& name) {
  return Env("MERIDIAN_BINARY_DIR", MERIDIAN_TEST_BINARY_DIR) + "/bin/" + name;
}
std::string Src(const std::string& path) { return Env("MERIDIAN_SOURCE_DIR", MERIDIAN_TEST_SOURCE_DIR) + "/" + path; }

struct Result {
  int rc;
  std::string out, err;
};

Result Exec(const std::string& cmd) {
  static int counter = 0;
  std::string errfile =
      (fs::temp_directory_path() / ("meridian_cli_err_" + std::to_string(::getpid()) + "_" + std::to_string(counter++)))
          .string();
  Result r;
  FILE* p = popen((cmd + " 2>" + errfile).c_str(), "r");
  std::array<char, 4096> buf;
  size_t n;
  while (p && (n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  int status = p ? pclose(p) : -1;
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream e(errfile);
  r.err.assign(std::istreambuf_iterator<char>(e), {});
  fs::remove(errfile);
  return r;
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("meridian_cli_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name) << text;
    return (dir_ / name).string();
  }
  fs::path dir_;
};

TEST_F(Cli, HelpAndVersion) {
  for (const char* b : {"meridian", "meridian-executor"}) {
    auto v = Exec(Bin(b) + " --version");
    EXPECT_EQ(v.rc, 0);
    EXPECT_THAT(v.out, HasSubstr("0."));
    auto h = Exec(Bin(b) + " --help");
    EXPECT_EQ(h.rc, 0);
    EXPECT_THAT(h.out, HasSubstr("Usage"));
  }
  for (const char* sub :
       {"validate", "certs", "certs init", "certs issue", "plan", "graph", "run", "train-local", "doctor"}) {
    auto h = Exec(Bin("meridian") + " " + sub + " --help");
    EXPECT_EQ(h.rc, 0) << sub;
    EXPECT_THAT(h.out, HasSubstr("Usage")) << sub;
  }
  EXPECT_EQ(Exec(Bin("meridian") + " frobnicate").rc, 2);
}

TEST_F(Cli, ValidateExitCodesAndFormat) {
  auto ok = Exec(Bin("meridian") + " validate " + Src("examples/clusters/local.yaml") + " " +
                 Src("examples/clusters/geo.yaml"));
  EXPECT_EQ(ok.rc, 0) << ok.err;
  EXPECT_THAT(ok.out, HasSubstr("local.yaml: ok (cluster 'local-demo' with 3 sites"));
  std::string bad = Write("bad.yaml",
                          "cluster: x\ncoordinator: {address: 127.0.0.1:1}\nsites:\n  - {name: a, address: nope}\n"
                          "links:\n  - {from: a, to: b, bandwidth: 0Mbit}\n");
  auto r = Exec(Bin("meridian") + " validate " + bad);
  EXPECT_EQ(r.rc, 2);
  EXPECT_THAT(r.err, HasSubstr(bad + ":4:"));
  EXPECT_THAT(r.err, HasSubstr(": error: site 'a'.address:"));
  EXPECT_THAT(r.err, HasSubstr(bad + ":6:"));
  // Every stderr line has the FILE:LINE:COL: error: form.
  size_t lines = 0, start = 0;
  while (start < r.err.size()) {
    size_t end = r.err.find('\n', start);
    std::string line = r.err.substr(start, end - start);
    EXPECT_THAT(line, ::testing::MatchesRegex(".*:[0-9]+:[0-9]+: error: .*")) << line;
    ++lines;
    start = end == std::string::npos ? r.err.size() : end + 1;
  }
  EXPECT_GE(lines, 3u);
  std::string binary = Write("bin.yaml", std::string("\x7f"
                                                     "ELF\0\0\x01",
                                                     7));
  auto b = Exec(Bin("meridian") + " validate " + binary);
  EXPECT_EQ(b.rc, 2);
  EXPECT_THAT(b.err, HasSubstr("not a text file"));
  auto missing = Exec(Bin("meridian") + " validate " + (dir_ / "missing.yaml").string());
  EXPECT_EQ(missing.rc, 2);
  EXPECT_THAT(missing.err, HasSubstr("missing.yaml:0:0: error: cannot open file"));
}

TEST_F(Cli, CertsInitAndIssueVerifyWithOpenssl) {
  std::string out = (dir_ / "certs").string();
  auto r = Exec(Bin("meridian") + " certs init --spec " + Src("examples/clusters/geo.yaml") + " --out " + out);
  ASSERT_EQ(r.rc, 0) << r.err;
  for (const char* n : {"coordinator", "frankfurt", "virginia", "oregon", "singapore"}) {
    auto v = Exec("openssl verify -CAfile " + out + "/ca.pem " + out + "/" + n + ".pem");
    EXPECT_EQ(v.rc, 0) << n << v.out << v.err;
  }
  auto again = Exec(Bin("meridian") + " certs init --spec " + Src("examples/clusters/geo.yaml") + " --out " + out);
  EXPECT_EQ(again.rc, 2);
  EXPECT_THAT(again.err, HasSubstr("--force"));
  auto issue = Exec(Bin("meridian") + " certs issue --ca-dir " + out + " --site tokyo --host 198.51.100.7");
  ASSERT_EQ(issue.rc, 0) << issue.err;
  EXPECT_EQ(Exec("openssl verify -CAfile " + out + "/ca.pem " + out + "/tokyo.pem").rc, 0);
  auto san = Exec("openssl x509 -noout -subject -ext subjectAltName -in " + out + "/tokyo.pem");
  EXPECT_THAT(san.out, HasSubstr("CN = tokyo"));
  EXPECT_THAT(san.out, HasSubstr("IP Address:198.51.100.7"));
  EXPECT_EQ(fs::status(out + "/tokyo.key").permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write);
  EXPECT_THAT(issue.out, HasSubstr("give site 'tokyo' only " + out + "/bundles/tokyo"));
  // Each site's bundle holds the CA certificate and that site's identity, nothing else.
  EXPECT_THAT(r.out, HasSubstr("  virginia: " + out + "/bundles/virginia"));
  for (const char* n : {"frankfurt", "virginia", "oregon", "singapore", "tokyo"}) {
    std::set<std::string> files;
    for (const auto& e : fs::directory_iterator(out + "/bundles/" + n)) files.insert(e.path().filename().string());
    EXPECT_EQ(files, (std::set<std::string>{"ca.pem", std::string(n) + ".pem", std::string(n) + ".key"})) << n;
    EXPECT_EQ(Exec("openssl verify -CAfile " + out + "/ca.pem " + out + "/bundles/" + n + "/" + n + ".pem").rc, 0);
  }
  EXPECT_FALSE(fs::exists(out + "/bundles/coordinator"));
}

TEST_F(Cli, DoctorChecksEveryIdentity) {
  std::string spec = Write("c.yaml",
                           "cluster: d\ncoordinator: {address: 127.0.0.1:1}\nsecurity: {certs: certs}\nsites:\n"
                           "  - {name: a, address: 127.0.0.1:2}\n  - {name: b, address: 127.0.0.1:3}\n");
  ASSERT_EQ(Exec(Bin("meridian") + " certs init --spec " + spec + " --out " + (dir_ / "certs").string()).rc, 0);
  auto ok = Exec(Bin("meridian") + " doctor " + spec);
  EXPECT_EQ(ok.rc, 0) << ok.out << ok.err;
  EXPECT_THAT(ok.out, HasSubstr("ok    identity 'b'"));
  EXPECT_THAT(ok.out, HasSubstr("no coordinator answers at 127.0.0.1:1"));
  EXPECT_THAT(ok.out, HasSubstr("ok    bundle for site 'b'"));
  // A bundle that carries the CA's key fails, naming the file.
  fs::copy_file(dir_ / "certs" / "ca.key", dir_ / "certs" / "bundles" / "a" / "ca.key");
  auto leaky = Exec(Bin("meridian") + " doctor " + spec);
  EXPECT_EQ(leaky.rc, 1);
  EXPECT_THAT(leaky.out, HasSubstr("FAIL  bundle for site 'a'"));
  EXPECT_THAT(leaky.out, HasSubstr("bundles/a/ca.key: the cluster CA's private key must not be at a site"));
  fs::remove(dir_ / "certs" / "b.key");
  auto bad = Exec(Bin("meridian") + " doctor " + spec);
  EXPECT_EQ(bad.rc, 1);
  EXPECT_THAT(bad.out, HasSubstr("FAIL  identity 'b'"));
  EXPECT_THAT(bad.out, HasSubstr("b.key"));
}

TEST_F(Cli, PlanTableJsonAndDot) {
  std::string graph = Src("examples/graphs/llama-7b.json"), profile = Src("examples/profiles/geo.json");
  auto t = Exec(Bin("meridian") + " plan --graph " + graph + " --profile " + profile + " --micro-batches 32");
  ASSERT_EQ(t.rc, 0) << t.err;
  EXPECT_THAT(t.out, HasSubstr("bottleneck:"));
  EXPECT_THAT(t.out, HasSubstr("predicted step time:"));
  EXPECT_THAT(t.out, HasSubstr("compute bound:"));
  std::string dot = (dir_ / "plan.dot").string();
  auto j =
      Exec(Bin("meridian") + " plan --graph " + graph + " --profile " + profile + " --reference --json --dot " + dot);
  ASSERT_EQ(j.rc, 0) << j.err;
  auto js = nlohmann::json::parse(j.out);
  EXPECT_GT(js["predicted_step_seconds"].get<double>(), js["compute_bound_seconds"].get<double>());
  ASSERT_FALSE(js["stages"].empty());
  EXPECT_EQ(js["stages"][0]["first_op"].get<int>(), 0);
  EXPECT_EQ(js["stages"].back()["last_op"].get<int>(), 65);
  EXPECT_EQ(js["links"].size() + 1, js["stages"].size());
  EXPECT_TRUE(fs::exists(dot));
  std::string bad = Write("g.json", R"({"ops": [{"name": "a", "forward_flops": 1}]})");
  auto b = Exec(Bin("meridian") + " plan --graph " + bad + " --profile " + profile);
  EXPECT_EQ(b.rc, 2);
  EXPECT_THAT(b.err, HasSubstr("ops[0].backward_flops: missing"));
}

// `meridian simulate` over a plan the planner wrote, as files and as a run directory.
TEST_F(Cli, SimulateAPlanFromFilesAndFromARunDirectory) {
  std::string graph = Src("examples/graphs/llama-7b.json"), profile = Src("examples/profiles/geo.json");
  auto p = Exec(Bin("meridian") + " plan --graph " + graph + " --profile " + profile + " --micro-batches 16 --json");
  ASSERT_EQ(p.rc, 0) << p.err;
  fs::create_directories(dir_ / "run");
  std::ofstream(dir_ / "run" / "plan.json") << p.out;
  fs::copy_file(graph, dir_ / "run" / "graph.json");
  fs::copy_file(profile, dir_ / "run" / "profile.json");
  const std::string svg = (dir_ / "t.svg").string();
  auto j = Exec(Bin("meridian") + " simulate --plan " + (dir_ / "run").string() + " --json --svg " + svg);
  ASSERT_EQ(j.rc, 0) << j.err;
  auto js = nlohmann::json::parse(j.out);
  for (const char* key : {"step_seconds", "utilisation", "bubble_fraction", "links", "stages"})
    EXPECT_TRUE(js.contains(key)) << key;
  const auto plan = nlohmann::json::parse(p.out);
  EXPECT_EQ(js["stages"].size(), plan["stages"].size());
  EXPECT_GE(js["step_seconds"].get<double>(), js["compute_bound_seconds"].get<double>());
  EXPECT_GT(js["utilisation"].get<double>(), 0);
  EXPECT_LE(js["utilisation"].get<double>(), 1);
  std::ifstream in(svg);
  std::string drawn((std::istreambuf_iterator<char>(in)), {});
  EXPECT_THAT(drawn, HasSubstr("<svg"));
  EXPECT_THAT(drawn, HasSubstr(">forward<"));
  auto t = Exec(Bin("meridian") + " simulate --plan " + (dir_ / "run" / "plan.json").string() + " --graph " + graph +
                " --profile " + profile);
  ASSERT_EQ(t.rc, 0) << t.err;
  EXPECT_THAT(t.out, HasSubstr("simulated step"));
  std::string bad = Write("p.json", R"({"micro_batches": 4, "stages": [{"sites": ["mars"], "last_op": 65}]})");
  auto b = Exec(Bin("meridian") + " simulate --plan " + bad + " --graph " + graph + " --profile " + profile);
  EXPECT_EQ(b.rc, 2);
  EXPECT_THAT(b.err, HasSubstr("stages[0].sites: site 'mars' is not in the profile"));
  // Failures over a long run: every plan site's MTBF, one site's overridden; goodput below 1, and lower
  // when that site fails more often; a site the plan lacks is named.
  const std::string first_site = plan["stages"][0]["sites"][0].get<std::string>();
  const std::string run = " simulate --plan " + (dir_ / "run").string() + " --json --mtbf-hours 200";
  auto f = Exec(Bin("meridian") + run);
  ASSERT_EQ(f.rc, 0) << f.err;
  const auto fj = nlohmann::json::parse(f.out)["failures"];
  for (const char* key : {"goodput", "goodput_p10", "analytic_goodput", "best_interval_steps", "system_mtbf_seconds"})
    EXPECT_TRUE(fj.contains(key)) << key;
  EXPECT_GT(fj["goodput"].get<double>(), 0);
  EXPECT_LT(fj["goodput"].get<double>(), 1);
  auto g = Exec(Bin("meridian") + run + " --site-mtbf " + first_site + "=2");
  ASSERT_EQ(g.rc, 0) << g.err;
  EXPECT_LT(nlohmann::json::parse(g.out)["failures"]["goodput"].get<double>(), fj["goodput"].get<double>());
  EXPECT_LT(nlohmann::json::parse(g.out)["failures"]["system_mtbf_seconds"].get<double>(),
            fj["system_mtbf_seconds"].get<double>());
  auto h = Exec(Bin("meridian") + run + " --site-mtbf mars=2");
  EXPECT_EQ(h.rc, 2);
  EXPECT_THAT(h.err, HasSubstr("the plan has no site 'mars'"));
}

// `meridian plan --simulate K`: the planner's K best layouts, simulated and ranked.
TEST_F(Cli, PlanSimulateRanksThePlannersBestCandidatesBySimulation) {
  std::string graph = Src("examples/graphs/llama-7b.json"), profile = Src("examples/profiles/geo.json");
  auto j = Exec(Bin("meridian") + " plan --graph " + graph + " --profile " + profile +
                " --micro-batches 16 --simulate 3 --json");
  ASSERT_EQ(j.rc, 0) << j.err;
  auto js = nlohmann::json::parse(j.out);
  ASSERT_EQ(js["simulated_candidates"].size(), 3u);
  std::set<int> ranks;
  double previous = 0;
  int first = 0;
  for (const auto& c : js["simulated_candidates"]) {
    ranks.insert(c["simulated_rank"].get<int>());
    EXPECT_GE(c["predicted_seconds"].get<double>(), previous);  // in the planner's order
    previous = c["predicted_seconds"].get<double>();
    EXPECT_GT(c["simulated_seconds"].get<double>(), 0);
    if (c["simulated_rank"].get<int>() == 1) first = &c - &js["simulated_candidates"][0];
  }
  EXPECT_EQ(ranks, (std::set<int>{1, 2, 3}));
  EXPECT_EQ(js["ranking_changed"].get<bool>(), first != 0);
  ASSERT_FALSE(js["stages"].empty());  // the plan the simulation ranks first
  auto t =
      Exec(Bin("meridian") + " plan --graph " + graph + " --profile " + profile + " --micro-batches 16 --simulate 3");
  ASSERT_EQ(t.rc, 0) << t.err;
  EXPECT_THAT(t.out, HasSubstr("sim_rank"));
  EXPECT_TRUE(t.out.find("the simulation changes the ranking") != std::string::npos ||
              t.out.find("the simulation keeps the planner's first candidate") != std::string::npos)
      << t.out;
}

TEST_F(Cli, ExecutorJoinFailsFastWithOneActionableMessage) {
  std::string certs = (dir_ / "certs").string();
  ASSERT_EQ(Exec(Bin("meridian") + " certs init --spec " + Src("examples/clusters/local.yaml") + " --out " + certs).rc,
            0);
  const std::string bundle = certs + "/bundles/fast";
  // Nobody listens on this port: a clear "cannot join" within the timeout.
  auto r =
      Exec(Bin("meridian-executor") + " --site fast --coordinator 127.0.0.1:1 --certs " + bundle + " --join-timeout 2");
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.err, HasSubstr("cannot join the coordinator at 127.0.0.1:1 as site 'fast'"));
  // The whole certificate directory, with the CA's key: refused before any network traffic, naming the file.
  auto whole = Exec(Bin("meridian-executor") + " --site fast --coordinator 127.0.0.1:1 --certs " + certs);
  EXPECT_EQ(whole.rc, 2);
  EXPECT_THAT(whole.err, HasSubstr(certs + "/ca.key: the cluster CA's private key must not be at a site"));
  // Another site's bundle holds another identity's key.
  auto u = Exec(Bin("meridian-executor") + " --site atlantis --coordinator 127.0.0.1:1 --certs " + bundle);
  EXPECT_EQ(u.rc, 2);
  EXPECT_THAT(u.err, HasSubstr("fast.key: another identity's private key"));
  // A bundle with no certificate for the site.
  fs::create_directories(dir_ / "empty");
  fs::copy_file(bundle + "/ca.pem", dir_ / "empty" / "ca.pem");
  auto missing = Exec(Bin("meridian-executor") + " --site atlantis --coordinator 127.0.0.1:1 --certs " +
                      (dir_ / "empty").string());
  EXPECT_EQ(missing.rc, 2);
  EXPECT_THAT(missing.err, HasSubstr("atlantis.pem"));
  auto bad = Exec(Bin("meridian-executor") + " --site fast --coordinator nope --certs " + bundle);
  EXPECT_EQ(bad.rc, 2);
  EXPECT_THAT(bad.err, HasSubstr("coordinator address"));
}

// examples/llm-finetune/untie.py, which the demo's base goes through: the tied model's one matrix is
// written out as the head too, the model computes what it did (the same first loss), a graph of it has no
// tied op left (so a pipeline can cut it), and a second pass leaves it as it is.
TEST_F(Cli, UntieKeepsTheModelAndLetsAPipelineCutIt) {
  fs::create_directories(dir_ / "init");
  std::ofstream(dir_ / "init" / "config.json")
      << R"({"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": true})";
  auto job = [&](const std::string& model, int steps) {
    return Write("job-" + model + ".yaml", "job:\n  model: " + model +
                                               "\n  data: synthetic\n  steps: " + std::to_string(steps) +
                                               "\n  global_batch: 4\n  micro_batches: 1\n  sequence_length: 16\n"
                                               "  seed: 7\n  optimizer: {name: adamw, lr: 0.01}\n");
  };
  const std::string env = "OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 ";
  auto pre = Exec(env + Bin("meridian") + " train-local " + job("init", 3) + " --out " + (dir_ / "tied").string());
  ASSERT_EQ(pre.rc, 0) << pre.err;
  fs::copy(dir_ / "tied", dir_ / "untied", fs::copy_options::recursive);
  const std::string untie = "/usr/bin/python3 " + Src("examples/llm-finetune/untie.py") + " ";
  auto u = Exec(untie + (dir_ / "untied").string());
  ASSERT_EQ(u.rc, 0) << u.err;
  EXPECT_THAT(u.out, HasSubstr("LM head untied from the embedding"));

  auto header = [](const fs::path& file) {
    std::ifstream in(file, std::ios::binary);
    uint64_t n = 0;
    in.read(reinterpret_cast<char*>(&n), 8);
    std::string text(n, '\0');
    in.read(text.data(), static_cast<std::streamsize>(n));
    return nlohmann::json::parse(text);
  };
  const auto before = header(dir_ / "tied" / "model.safetensors");
  const auto after = header(dir_ / "untied" / "model.safetensors");
  EXPECT_FALSE(before.contains("lm_head.weight"));
  ASSERT_TRUE(after.contains("lm_head.weight"));
  EXPECT_EQ(after["lm_head.weight"]["shape"], after["model.embed_tokens.weight"]["shape"]);
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(dir_ / "untied" / "config.json"))["tie_word_embeddings"], false);

  // The same function: the first step's loss (before any update) is the same, to the digits printed.
  auto first_loss = [&](const std::string& model) {
    auto r =
        Exec(env + Bin("meridian") + " train-local " + job(model, 1) + " --out " + (dir_ / ("ft-" + model)).string());
    EXPECT_EQ(r.rc, 0) << r.err;
    return r.out.substr(0, r.out.find('\n'));
  };
  const std::string tied_loss = first_loss("tied");
  EXPECT_THAT(tied_loss, HasSubstr("step 0 loss"));
  EXPECT_EQ(first_loss("untied"), tied_loss);

  // The tied model's graph keeps the head with the embedding; the untied one's has no tie.
  auto graph = [&](const std::string& model) {
    auto g = Exec(Bin("meridian") + " graph --config " + (dir_ / model / "config.json").string() +
                  " --seq-len 16 --micro-batch-size 1");
    EXPECT_EQ(g.rc, 0) << g.err;
    return g.out;
  };
  EXPECT_THAT(graph("tied"), HasSubstr("tied_to"));
  EXPECT_THAT(graph("untied"), ::testing::Not(HasSubstr("tied_to")));

  auto again = Exec(untie + (dir_ / "untied").string());
  EXPECT_EQ(again.rc, 0) << again.err;
  EXPECT_THAT(again.out, HasSubstr("already untied"));
  auto sharded = Exec(untie + (dir_ / "init").string());  // no model.safetensors
  EXPECT_NE(sharded.rc, 0);
  EXPECT_THAT(sharded.err, HasSubstr("no such file"));
}

}  // namespace
