#include "launch/launch.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>

namespace meridian::launch {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(Launch, ShellQuoteSurvivesTheRemoteShell) {
  EXPECT_EQ(ShellQuote("plain"), "'plain'");
  EXPECT_EQ(ShellQuote("it's; rm -rf /"), "'it'\\''s; rm -rf /'");
  // What the shell reads back is the word itself.
  auto r = RunCommand({"sh", "-c", "printf %s " + ShellQuote("a b'c$(x)")}, std::chrono::seconds(10));
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.out, "a b'c$(x)");
}

TEST(Launch, SshArgvChecksHostKeysAndUsesOnlyTheGivenKey) {
  core::SshSpec ssh;
  ssh.host = "10.0.0.2";
  ssh.user = "train";
  ssh.port = 2222;
  ssh.identity_file = "/keys/id";
  ssh.known_hosts = "/keys/known_hosts";
  LaunchOptions o;
  auto argv = SshArgv(ssh, o, "true");
  auto has = [&](const std::string& a) { return std::find(argv.begin(), argv.end(), a) != argv.end(); };
  EXPECT_EQ(argv.front(), "ssh");
  EXPECT_TRUE(has("BatchMode=yes"));
  EXPECT_TRUE(has("StrictHostKeyChecking=yes"));
  EXPECT_TRUE(has("UserKnownHostsFile=/keys/known_hosts"));
  EXPECT_TRUE(has("IdentitiesOnly=yes"));
  EXPECT_TRUE(has("/keys/id"));
  EXPECT_TRUE(has("2222"));
  EXPECT_TRUE(has("train"));
  EXPECT_EQ(argv[argv.size() - 2], "10.0.0.2");
  EXPECT_EQ(argv.back(), "true");
  o.accept_new_host_keys = true;
  argv = SshArgv(ssh, o, "true");
  EXPECT_TRUE(has("StrictHostKeyChecking=accept-new"));
}

TEST(Launch, SshFailuresAreExplainedWithWhatToDo) {
  core::SshSpec ssh;
  ssh.host = "h";
  ssh.known_hosts = "/kh";
  ssh.identity_file = "/id";
  EXPECT_THAT(ExplainSshFailure(ssh,
                                "No ED25519 host key is known for h and you have requested strict checking.\n"
                                "Host key verification failed.\n"),
              HasSubstr("--accept-new-host-keys"));
  EXPECT_THAT(ExplainSshFailure(ssh, "@ WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED! @\n"),
              HasSubstr("ssh-keygen -R h -f /kh"));
  EXPECT_THAT(ExplainSshFailure(ssh, "root@h: Permission denied (publickey).\n"), HasSubstr("refused the key /id"));
  EXPECT_THAT(ExplainSshFailure(ssh, "ssh: connect to host h port 22: Connection refused\n"),
              HasSubstr("cannot reach h:22"));
  EXPECT_EQ(ExplainSshFailure(ssh, "something else"), "");
}

TEST(Launch, ProblemLinesOfTheExecutorLogAreTheOnesReported) {
  EXPECT_TRUE(IsProblemLine("[2026-12-02 10:00:00.000] [error] stage 1: out of memory"));
  EXPECT_TRUE(IsProblemLine("[warning] slow link"));
  EXPECT_TRUE(IsProblemLine("meridian-executor: join failed: coordinator unreachable"));
  EXPECT_FALSE(IsProblemLine("[info] joined coordinator at 10.0.0.1:7000"));
}

TEST(Launch, RunCommandReportsExitCodesOutputAndTimeouts) {
  auto ok = RunCommand({"sh", "-c", "echo out; echo err >&2; exit 3"}, std::chrono::seconds(10));
  EXPECT_EQ(ok.exit_code, 3);
  EXPECT_EQ(ok.out, "out\n");
  EXPECT_EQ(ok.err, "err\n");
  auto missing = RunCommand({"/nonexistent/binary"}, std::chrono::seconds(10));
  EXPECT_TRUE(missing.spawn_failed);
  EXPECT_THAT(missing.err, HasSubstr("cannot run /nonexistent/binary here"));
  const auto t0 = std::chrono::steady_clock::now();
  auto slow = RunCommand({"sh", "-c", "sleep 30"}, std::chrono::milliseconds(300));
  EXPECT_EQ(slow.exit_code, -1);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
}

TEST(Launch, AMissingBundleIsNamedBeforeAnyLogin) {
  SshLauncher l(
      {}, [](const std::string&, const std::string&) {}, [](const std::string&, const std::string&) {});
  SiteLaunch s;
  s.site = "a";
  s.ssh.host = "192.0.2.1";  // TEST-NET: never contacted, the bundle check comes first
  s.bundle_dir = "/nonexistent/bundles/a";
  auto st = l.Launch(s);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("site 'a'"));
  EXPECT_THAT(st.message(), HasSubstr("has no ca.pem"));
  EXPECT_THAT(l.Started(), ElementsAre());
}

}  // namespace
}  // namespace meridian::launch
