// The deployment templates of examples/deploy (#22). The Slurm batch script runs a real site, by bash
// and submitted with sbatch to a single-node cluster of Debian's slurm-wlm started for the test (skipped,
// saying why, where slurmctld cannot start). The Kubernetes manifest and the systemd unit are checked for
// the fields a site depends on.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include "tests/process.h"
#include "tests/test_util.h"

namespace meridian {
namespace {

namespace fs = std::filesystem;
using testing::Bin;
using testing::FreePort;
using ::testing::HasSubstr;
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

// A 2-site run whose site b (two CPU workers) is started by `start_b`, given b's environment as the
// batch script reads it; returns the coordinator's output. Asserts that the run completes.
std::string RunWithSiteB(const fs::path& dir,
                         const std::function<std::unique_ptr<Process>(const std::string&)>& start_b,
                         std::unique_ptr<Process>* b) {
  std::ofstream(dir / "model" / "config.json")
      << R"({"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": false})";
  const int coord_port = FreePort(), a_port = FreePort(), b_port = FreePort();
  std::ofstream(dir / "cluster.yaml") << "cluster: t\ncoordinator: {address: 127.0.0.1:" << coord_port
                                      << "}\nsecurity: {certs: certs}\nheartbeat: {interval: 1s, timeout: 4s}\n"
                                      << "elastic: {enabled: false}\nsites:\n  - {name: a, address: 127.0.0.1:"
                                      << a_port << "}\n  - {name: b, address: 127.0.0.1:" << b_port
                                      << ", devices: [cpu, cpu]}\n";
  std::ofstream(dir / "job.yaml") << "job:\n  model: model\n  data: synthetic\n  steps: 4\n  global_batch: 4\n"
                                     "  micro_batches: 2\n  sequence_length: 16\n  seed: 7\n"
                                     "  compression: {policy: none}\n";
  Process certs(Bin("meridian") + " certs init --spec " + (dir / "cluster.yaml").string() + " --out " +
                (dir / "certs").string());
  EXPECT_EQ(certs.Wait(30s), 0);
  std::ofstream(dir / "plan.json") << R"({"stages": [{"sites": ["a"], "last_op": 2}, {"sites": ["b"], "last_op": 5}]})";
  Process coord(Bin("meridian") + " run " + (dir / "cluster.yaml").string() + " " + (dir / "job.yaml").string() +
                " --run-dir " + (dir / "run").string() + " --plan " + (dir / "plan.json").string() +
                " --join-timeout 60 --probe-seconds 0.2 2>&1");
  std::this_thread::sleep_for(500ms);
  Process a(Bin("meridian-executor") + " --coordinator 127.0.0.1:" + std::to_string(coord_port) + " --site a --certs " +
            (dir / "certs" / "bundles" / "a").string() + " --listen 127.0.0.1:" + std::to_string(a_port) + " 2>&1");
  // What sbatch --export=ALL,... gives the batch script.
  *b = start_b("MERIDIAN_SITE=b MERIDIAN_COORDINATOR=127.0.0.1:" + std::to_string(coord_port) +
               " MERIDIAN_CERTS=" + (dir / "certs" / "bundles" / "b").string() +
               " MERIDIAN_EXECUTOR=" + Bin("meridian-executor") + " MERIDIAN_PORT=" + std::to_string(b_port) +
               " MERIDIAN_LISTEN=127.0.0.1:" + std::to_string(b_port) + " MERIDIAN_ADVERTISE_HOST=127.0.0.1");
  const std::string log = coord.ReadAll(180s);
  EXPECT_EQ(coord.Wait(30s), 0) << log;
  EXPECT_THAT(log, HasSubstr("done: 4 steps"));
  EXPECT_EQ(a.Wait(30s), 0);
  return log;
}

TEST_F(DeployTest, TheSlurmBatchScriptRunsASitesExecutorAndNamesWhatIsMissing) {
  Process missing("env -u MERIDIAN_SITE bash " + kDeploy + "/slurm/meridian-site.sbatch 2>&1");
  const std::string said = missing.ReadAll(10s);
  EXPECT_EQ(missing.Wait(10s), 2) << said;
  EXPECT_THAT(said, HasSubstr("set MERIDIAN_SITE"));
  // Run by bash, as a batch step runs it.
  std::unique_ptr<Process> b;
  RunWithSiteB(
      dir_,
      [](const std::string& env) {
        return std::make_unique<Process>(env + " SLURM_JOB_ID=4242 bash " + kDeploy +
                                         "/slurm/meridian-site.sbatch 2>&1");
      },
      &b);
  const std::string b_log = b->ReadAll(30s);
  EXPECT_EQ(b->Wait(30s), 0) << b_log;
  EXPECT_THAT(b_log, ::testing::ContainsRegex("site b on 127.0.0.1 \\(Slurm job 4242\\), peers dial 127.0.0.1:[0-9]+"));
  EXPECT_THAT(b_log, HasSubstr("site 'b' worker 1 of 2: done after step 4"));
  EXPECT_THAT(b_log, HasSubstr("site b: executor exited with 0"));
}

// A single-node Slurm cluster of Debian's slurm-wlm (slurmctld and slurmd as root, munge), started for
// the test and shut down after it; skipped, saying why, where it cannot start.
class SlurmCluster {
 public:
  explicit SlurmCluster(const fs::path& dir) : dir_(dir) {}
  ~SlurmCluster() {
    if (started_) std::system(("SLURM_CONF=" + conf() + " scontrol shutdown >/dev/null 2>&1").c_str());
    for (const char* pid : {"slurmctld.pid", "slurmd.pid"}) {
      std::ifstream in(dir_ / pid);
      int p = 0;
      if (in >> p && p > 0) ::kill(p, SIGKILL);
    }
  }
  // Empty when running, else why not.
  std::string Start() {
    if (::geteuid() != 0) return "not root";
    if (std::system(
            "command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null") != 0)
      return "slurm-wlm is not installed";
    if (std::system("munge -n >/dev/null 2>&1") != 0 &&  // start munged for slurm's authentication
        std::system("mkdir -p /run/munge && chown munge:munge /run/munge && su -s /bin/sh munge -c munged") != 0)
      return "munged does not start";
    fs::create_directories(dir_ / "state");
    fs::create_directories(dir_ / "spool");
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    const int ctld = FreePort(), slurmd = FreePort();
    std::ofstream(conf()) << "ClusterName=meridiantest\nSlurmctldHost=" << host << "(127.0.0.1)\nSlurmUser=root\n"
                          << "SlurmdUser=root\nSlurmctldPort=" << ctld << "\nSlurmdPort=" << slurmd
                          << "\nAuthType=auth/munge\nStateSaveLocation=" << (dir_ / "state").string()
                          << "\nSlurmdSpoolDir=" << (dir_ / "spool").string()
                          << "\nSlurmctldPidFile=" << (dir_ / "slurmctld.pid").string()
                          << "\nSlurmdPidFile=" << (dir_ / "slurmd.pid").string()
                          << "\nSlurmctldLogFile=" << (dir_ / "slurmctld.log").string()
                          << "\nSlurmdLogFile=" << (dir_ / "slurmd.log").string()
                          << "\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
                             "JobAcctGatherType=jobacct_gather/none\nSchedulerType=sched/builtin\n"
                             "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\nReturnToService=2\n"
                             "MpiDefault=none\nNodeName="
                          << host
                          << " NodeAddr=127.0.0.1 CPUs=2 RealMemory=1000 State=UNKNOWN\nPartitionName=debug Nodes="
                          << host << " Default=YES MaxTime=INFINITE State=UP\n";
    started_ = true;
    if (std::system(("SLURM_CONF=" + conf() + " slurmctld -c -i && SLURM_CONF=" + conf() + " slurmd").c_str()) != 0)
      return "slurmctld or slurmd does not start (" + (dir_ / "slurmctld.log").string() + ")";
    for (int i = 0; i < 100; ++i) {
      if (std::system(("SLURM_CONF=" + conf() + " sinfo -h -o %t 2>/dev/null | grep -q idle").c_str()) == 0) return "";
      std::this_thread::sleep_for(200ms);
    }
    return "the node does not become idle";
  }
  std::string conf() const { return (dir_ / "slurm.conf").string(); }

 private:
  fs::path dir_;
  bool started_ = false;
};

// The batch script submitted with sbatch to a single-node Slurm cluster runs site b of a real run.
TEST_F(DeployTest, TheSlurmBatchScriptRunsASiteUnderSbatch) {
  SlurmCluster slurm(dir_ / "slurm");
  if (const std::string why = slurm.Start(); !why.empty()) GTEST_SKIP() << "no Slurm here: " << why;
  const std::string out = (dir_ / "site-b-%j.log").string();
  std::unique_ptr<Process> b;
  RunWithSiteB(
      dir_,
      [&](const std::string& env) {
        // sbatch returns at once ("Submitted batch job N"); the job's output goes to `out`.
        return std::make_unique<Process>("env " + env + " SLURM_CONF=" + slurm.conf() + " sbatch --export=ALL -o " +
                                         out + " " + kDeploy + "/slurm/meridian-site.sbatch 2>&1");
      },
      &b);
  const std::string submitted = b->ReadAll(30s);
  ASSERT_EQ(b->Wait(30s), 0) << submitted;
  const int job = std::atoi(submitted.c_str() + submitted.find_first_of("0123456789"));
  ASSERT_GT(job, 0) << submitted;
  const fs::path job_log = dir_ / ("site-b-" + std::to_string(job) + ".log");
  std::string text;
  for (int i = 0; i < 150 && text.find("executor exited with") == std::string::npos; ++i) {
    std::this_thread::sleep_for(200ms);
    std::ifstream in(job_log);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  EXPECT_THAT(text, HasSubstr("(Slurm job " + std::to_string(job) + ")")) << text;
  EXPECT_THAT(text, HasSubstr("site 'b' worker 1 of 2: done after step 4")) << text;
  EXPECT_THAT(text, HasSubstr("site b: executor exited with 0")) << text;
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
