// The deployment templates of examples/deploy (#22). The Slurm batch script runs a real site: here by
// bash, as sbatch would run its batch step (Debian's slurm-wlm is not installed by scripts/setup.sh, so no
// slurmctld runs here; the test says so). The Kubernetes manifest and the systemd unit are checked for the
// fields a site depends on.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "tests/process.h"
#include "tests/test_util.h"

namespace meridian {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using testing::Bin;
using testing::FreePort;
using testing::Process;
using namespace std::chrono_literals;

const std::string kDeploy = std::string(MERIDIAN_TEST_SOURCE_DIR) + "/examples/deploy";

class DeployTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("meridian_deploy_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "model");
    ::setenv("OPENBLAS_NUM_THREADS", "1", 1);
    ::setenv("OMP_NUM_THREADS", "1", 1);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(DeployTest, TheSlurmBatchScriptRunsASitesExecutorAndNamesWhatIsMissing) {
  Process missing("env -u MERIDIAN_SITE bash " + kDeploy + "/slurm/meridian-site.sbatch 2>&1");
  const std::string said = missing.ReadAll(10s);
  EXPECT_EQ(missing.Wait(10s), 2) << said;
  EXPECT_THAT(said, HasSubstr("set MERIDIAN_SITE"));
  if (std::system("command -v slurmctld >/dev/null 2>&1") != 0)
    std::cout << "note: slurmctld is not installed here (slurm-wlm); the batch script runs under bash, as "
                 "sbatch runs a batch step\n";

  std::ofstream(dir_ / "model" / "config.json")
      << R"({"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": false})";
  const int coord_port = FreePort(), a_port = FreePort(), b_port = FreePort();
  std::ofstream(dir_ / "cluster.yaml") << "cluster: t\ncoordinator: {address: 127.0.0.1:" << coord_port
                                       << "}\nsecurity: {certs: certs}\nheartbeat: {interval: 1s, timeout: 4s}\n"
                                       << "elastic: {enabled: false}\nsites:\n  - {name: a, address: 127.0.0.1:"
                                       << a_port << "}\n  - {name: b, address: 127.0.0.1:" << b_port
                                       << ", devices: [cpu, cpu]}\n";
  std::ofstream(dir_ / "job.yaml") << "job:\n  model: model\n  data: synthetic\n  steps: 4\n  global_batch: 4\n"
                                      "  micro_batches: 2\n  sequence_length: 16\n  seed: 7\n"
                                      "  compression: {policy: none}\n";
  Process certs(Bin("meridian") + " certs init --spec " + (dir_ / "cluster.yaml").string() + " --out " +
                (dir_ / "certs").string());
  ASSERT_EQ(certs.Wait(30s), 0);
  std::ofstream(dir_ / "plan.json") << R"({"stages": [{"sites": ["a"], "last_op": 2}, {"sites": ["b"], "last_op": 5}]})";
  Process coord(Bin("meridian") + " run " + (dir_ / "cluster.yaml").string() + " " + (dir_ / "job.yaml").string() +
                " --run-dir " + (dir_ / "run").string() + " --plan " + (dir_ / "plan.json").string() +
                " --join-timeout 60 2>&1");
  std::this_thread::sleep_for(500ms);
  Process a(Bin("meridian-executor") + " --coordinator 127.0.0.1:" + std::to_string(coord_port) + " --site a --certs " +
            (dir_ / "certs" / "bundles" / "a").string() + " --listen 127.0.0.1:" + std::to_string(a_port) + " 2>&1");
  // Site b through the batch script, with the environment sbatch --export would give it.
  Process b("MERIDIAN_SITE=b MERIDIAN_COORDINATOR=127.0.0.1:" + std::to_string(coord_port) +
            " MERIDIAN_CERTS=" + (dir_ / "certs" / "bundles" / "b").string() + " MERIDIAN_EXECUTOR=" +
            Bin("meridian-executor") + " MERIDIAN_PORT=" + std::to_string(b_port) +
            " MERIDIAN_LISTEN=127.0.0.1:" + std::to_string(b_port) +
            " MERIDIAN_ADVERTISE_HOST=127.0.0.1 SLURM_JOB_ID=4242 bash " + kDeploy + "/slurm/meridian-site.sbatch 2>&1");
  const std::string log = coord.ReadAll(180s);
  ASSERT_EQ(coord.Wait(30s), 0) << log;
  EXPECT_THAT(log, HasSubstr("done: 4 steps"));
  const std::string b_log = b.ReadAll(30s);
  EXPECT_EQ(b.Wait(30s), 0) << b_log;
  EXPECT_EQ(a.Wait(30s), 0);
  EXPECT_THAT(b_log, HasSubstr("site b on 127.0.0.1 (Slurm job 4242), peers dial 127.0.0.1:" + std::to_string(b_port)));
  EXPECT_THAT(b_log, HasSubstr("site 'b' worker 1 of 2: done after step 4"));
  EXPECT_THAT(b_log, HasSubstr("site b: executor exited with 0"));
}

TEST_F(DeployTest, TheKubernetesManifestAndTheSystemdUnitCarryWhatASiteNeeds) {
  // The manifest: a Service and a StatefulSet of one pod, the bundle from a Secret, SIGTERM's grace.
  const std::string check = R"(
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
kinds = sorted(d["kind"] for d in docs)
assert kinds == ["Service", "StatefulSet"], kinds
ss = next(d for d in docs if d["kind"] == "StatefulSet")["spec"]
assert ss["replicas"] == 1
pod = ss["template"]["spec"]
assert pod["terminationGracePeriodSeconds"] >= 60
c = pod["containers"][0]
env = {e["name"]: e["value"] for e in c["env"]}
for k in ("MERIDIAN_SITE", "MERIDIAN_COORDINATOR", "MERIDIAN_CERTS", "MERIDIAN_LISTEN"):
    assert k in env, k
mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
assert mounts["certs"] == env["MERIDIAN_CERTS"]
secret = next(v for v in pod["volumes"] if v["name"] == "certs")["secret"]
assert secret["secretName"].endswith("-certs")
print("manifest ok")
)";
  std::ofstream(dir_ / "check.py") << check;
  Process k8s("/usr/bin/python3 " + (dir_ / "check.py").string() + " " + kDeploy +
              "/kubernetes/meridian-site.yaml 2>&1");
  const std::string k8s_out = k8s.ReadAll(30s);
  EXPECT_EQ(k8s.Wait(10s), 0) << k8s_out;
  EXPECT_THAT(k8s_out, HasSubstr("manifest ok"));

  std::ifstream unit(kDeploy + "/systemd/meridian-executor@.service");
  const std::string text((std::istreambuf_iterator<char>(unit)), {});
  for (const char* line : {"EnvironmentFile=/etc/meridian/%i.env", "ExecStart=/usr/local/bin/meridian-executor",
                           "KillSignal=SIGTERM", "Restart=on-failure", "RestartPreventExitStatus=2"})
    EXPECT_THAT(text, HasSubstr(std::string("\n") + line + "\n")) << line;
  if (std::system("command -v systemd-analyze >/dev/null 2>&1") == 0) {
    Process verify("systemd-analyze verify " + kDeploy + "/systemd/meridian-executor@.service 2>&1");
    const std::string out = verify.ReadAll(30s);
    EXPECT_THAT(out, ::testing::Not(HasSubstr("Unknown key"))) << out;
  } else {
    std::cout << "note: systemd-analyze is not installed here; the unit's keys were checked as text\n";
  }
}

}  // namespace
}  // namespace meridian
