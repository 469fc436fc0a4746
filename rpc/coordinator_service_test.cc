// The coordinator service's authentication and authorisation, exercised with clients we did not write:
// python3-grpcio (tests/foreign_client.py) and `openssl s_client`.
#include "rpc/coordinator_service.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <filesystem>

#include "core/certs.h"
#include "rpc/credentials.h"

namespace meridian::rpc {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class CountingHandler : public CoordinatorHandler {
 public:
  absl::StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& r) override {
    ++calls;
    v1::RegisterResponse resp;
    resp.set_cluster("t");
    resp.set_run_id("run-1");
    return resp;
  }
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest&) override {
    ++calls;
    return v1::HeartbeatResponse();
  }
  absl::StatusOr<std::optional<v1::Command>> NextCommand(const std::string&, std::chrono::milliseconds) override {
    ++calls;
    v1::Command c;
    c.set_stop(true);
    return std::optional<v1::Command>(c);
  }
  void Requeue(const std::string&, v1::Command) override { ++calls; }
  absl::StatusOr<v1::InspectResponse> Inspect() override {
    ++calls;
    return v1::InspectResponse();
  }
  absl::Status Metrics(const v1::MetricsReport&) override {
    ++calls;
    return absl::OkStatus();
  }
  absl::Status Profile(const v1::ProfileReport&) override {
    ++calls;
    return absl::OkStatus();
  }
  absl::Status Done(const v1::StageDone&) override {
    ++calls;
    return absl::OkStatus();
  }
  std::atomic<int> calls{0};
};

std::pair<int, std::string> Shell(const std::string& cmd) {
  std::string out;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  std::array<char, 4096> buf;
  while (p && fgets(buf.data(), buf.size(), p)) out += buf.data();
  int rc = p ? pclose(p) : -1;
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, out};
}

class CoordinatorAuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("meridian_coordauth_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    core::ClusterSpec spec;
    spec.name = "t";
    spec.coordinator = {"127.0.0.1", 1};
    spec.sites = {{"a", {"127.0.0.1", 2}}, {"b", {"127.0.0.1", 3}}};
    std::vector<std::string> w;
    ASSERT_TRUE(core::InitClusterCerts(spec, (dir_ / "ours").string(), {}, &w).ok());
    spec.name = "other";
    ASSERT_TRUE(core::InitClusterCerts(spec, (dir_ / "theirs").string(), {}, &w).ok());
    service_ = std::make_unique<CoordinatorService>(std::set<std::string>{"a", "b"}, &handler_);
    grpc::ServerBuilder builder;
    ConfigureServer(&builder);
    builder.AddListeningPort("127.0.0.1:0", *MakeServerCredentials((dir_ / "ours").string(), "coordinator"), &port_);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_TRUE(server_);
  }
  void TearDown() override {
    server_->Shutdown(std::chrono::system_clock::now());
    fs::remove_all(dir_);
  }
  // Runs the Python client; returns the status code name it printed.
  std::string Python(const std::string& site, const std::string& args) {
    std::string script = std::string(MERIDIAN_TEST_SOURCE_DIR) + "/tests/foreign_client.py";
    auto [rc, out] = Shell("/usr/bin/python3 " + script + " 127.0.0.1:" + std::to_string(port_) + " " + site + " " + args);
    EXPECT_EQ(rc, 0) << out;
    return out.substr(0, out.find('\n'));
  }
  std::string Ours(const std::string& f) { return (dir_ / "ours" / f).string(); }
  std::string Theirs(const std::string& f) { return (dir_ / "theirs" / f).string(); }

  fs::path dir_;
  CountingHandler handler_;
  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

TEST_F(CoordinatorAuthTest, ValidSiteIsServed) {
  EXPECT_EQ(Python("a", "--ca " + Ours("ca.pem") + " --cert " + Ours("a.pem") + " --key " + Ours("a.key")), "OK");
  EXPECT_EQ(handler_.calls.load(), 1);
}

TEST_F(CoordinatorAuthTest, NoClientCertificateIsRejected) {
  EXPECT_EQ(Python("a", "--ca " + Ours("ca.pem")), "UNAVAILABLE");
  EXPECT_EQ(handler_.calls.load(), 0);
  EXPECT_EQ(service_->handled_calls(), 0);
}

TEST_F(CoordinatorAuthTest, CertificateFromAnotherCaIsRejected) {
  EXPECT_EQ(Python("a", "--ca " + Ours("ca.pem") + " --cert " + Theirs("a.pem") + " --key " + Theirs("a.key")),
            "UNAVAILABLE");
  EXPECT_EQ(handler_.calls.load(), 0);
}

TEST_F(CoordinatorAuthTest, ValidCertificateOfAnotherSiteCannotRegisterAsThisOne) {
  EXPECT_EQ(Python("a", "--ca " + Ours("ca.pem") + " --cert " + Ours("b.pem") + " --key " + Ours("b.key")),
            "PERMISSION_DENIED");
  EXPECT_EQ(handler_.calls.load(), 0);
  // The coordinator's own certificate is not a site either.
  EXPECT_EQ(Python("coordinator", "--ca " + Ours("ca.pem") + " --cert " + Ours("coordinator.pem") + " --key " +
                                      Ours("coordinator.key")),
            "PERMISSION_DENIED");
  EXPECT_EQ(handler_.calls.load(), 0);
}

TEST_F(CoordinatorAuthTest, ProtocolVersionMismatchIsExplained) {
  EXPECT_EQ(Python("a", "--version 99 --ca " + Ours("ca.pem") + " --cert " + Ours("a.pem") + " --key " + Ours("a.key")),
            "FAILED_PRECONDITION");
  EXPECT_EQ(handler_.calls.load(), 0);
}

TEST_F(CoordinatorAuthTest, OpensslSeesTls13AndARequiredClientCertificate) {
  auto [rc, out] = Shell("openssl s_client -connect 127.0.0.1:" + std::to_string(port_) + " -CAfile " + Ours("ca.pem") +
                         " -servername coordinator -alpn h2 </dev/null");
  EXPECT_THAT(out, HasSubstr("TLSv1.3"));
  EXPECT_THAT(out, HasSubstr("Verification: OK"));
  // The server sent a CertificateRequest: s_client lists what it asked for.
  EXPECT_THAT(out, ::testing::AnyOf(HasSubstr("Requested Signature Algorithms"),
                                    HasSubstr("Acceptable client certificate CA names")));
  EXPECT_EQ(handler_.calls.load(), 0);
}

}  // namespace
}  // namespace meridian::rpc
