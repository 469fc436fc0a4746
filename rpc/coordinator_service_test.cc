// The coordinator service's authentication and authorisation, exercised with clients we did not write:
// python3-grpcio (tests/foreign_client.py) and `openssl s_client`.
#include "rpc/coordinator_service.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <openssl/evp.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <thread>

#include "core/certs.h"
#include "core/version.h"
#include "rpc/coordinator_client.h"
#include "rpc/credentials.h"
#include "tests/test_util.h"

namespace meridian::rpc {
namespace {

namespace fs = std::filesystem;
using meridian::testing::Shell;
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
  absl::StatusOr<v1::DrainResponse> Drain(const std::string& site) override {
    ++calls;
    v1::DrainResponse r;
    r.set_message("draining " + site);
    return r;
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
  absl::StatusOr<FileGrant> FileDestination(const std::string& site, const std::string& job_id,
                                            const std::string& path) override {
    ++calls;
    if (job_id != "job-1") return absl::FailedPreconditionError("attempt '" + job_id + "' is over");
    if (site == "b") return absl::PermissionDeniedError("site 'b' writes no stage's files");
    fs::create_directories(fs::path(store) / fs::path(path).parent_path());
    return FileGrant{(fs::path(store) / path).string(), 12 * 1000 * 1000};
  }
  absl::Status FileCommit(const std::string&, const std::string&, const std::string&, const std::string& part,
                          const std::string& dest, int64_t, const std::string&) override {
    ++calls;
    fs::rename(part, dest);
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> FileSource(const std::string&, const std::string& path) override {
    ++calls;
    if (!fs::exists(fs::path(store) / path)) return absl::NotFoundError("no " + path);
    return (fs::path(store) / path).string();
  }
  std::atomic<int> calls{0};
  std::string store;
};

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
    handler_.store = (dir_ / "store").string();
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
    auto [rc, out] =
        Shell("/usr/bin/python3 " + script + " 127.0.0.1:" + std::to_string(port_) + " " + site + " " + args);
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

// Uploads `data` as `path` with `site`'s certificate (claiming `claimed`), in chunks of `chunk` bytes;
// `sha` empty: the data's true SHA-256; "none": no checksum sent.
grpc::Status Upload(const fs::path& certs, int port, const std::string& site, const std::string& claimed,
                    const std::string& job_id, const std::string& path, const std::string& data, size_t chunk,
                    std::string sha = "", v1::FileAck* ack_out = nullptr) {
  auto creds = MakeChannelCredentials(certs.string(), site);
  EXPECT_TRUE(creds.ok()) << creds.status();
  auto stub = v1::Coordinator::NewStub(
      grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port), *creds, PeerChannelArguments("coordinator")));
  if (sha.empty()) {
    unsigned char d[EVP_MAX_MD_SIZE];
    unsigned n = 0;
    EVP_Digest(data.data(), data.size(), d, &n, EVP_sha256(), nullptr);
    std::ostringstream hex;
    for (unsigned i = 0; i < n; ++i) hex << std::hex << (d[i] >> 4) << (d[i] & 15);
    sha = hex.str();
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::FileAck ack;
  auto writer = stub->PutFile(&ctx, &ack);
  for (size_t off = 0; off == 0 || off < data.size(); off += chunk) {
    v1::FileChunk c;
    if (off == 0) c.set_site(claimed), c.set_job_id(job_id), c.set_path(path);
    c.set_data(data.substr(off, chunk));
    if (off + chunk >= data.size() && sha != "none") c.set_sha256(sha);
    if (!writer->Write(c)) break;
  }
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  if (ack_out) *ack_out = ack;
  return s;
}

// A site sends a file of the run to the coordinator: it appears whole, with the bytes sent, only at the
// accepted path, only under the sender's own name and attempt, and only when its SHA-256 matches.
TEST_F(CoordinatorAuthTest, PutFileStoresTheWholeFileOrNothing) {
  std::string data(10 * 1000 * 1000 + 7, '\0');
  std::mt19937 rng(5);
  for (auto& c : data) c = static_cast<char>(rng());
  const fs::path stored = dir_ / "store" / "weights" / "stage-1.safetensors";
  v1::FileAck ack;
  grpc::Status ok =
      Upload(dir_ / "ours", port_, "a", "a", "job-1", "weights/stage-1.safetensors", data, 1 << 20, "", &ack);
  ASSERT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_EQ(ack.bytes(), static_cast<int64_t>(data.size()));
  std::ifstream in(stored, std::ios::binary);
  std::string back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(back == data) << "stored " << back.size() << " bytes";
  fs::remove(stored);
  auto nothing_left = [&] {
    size_t files = 0;
    if (fs::exists(dir_ / "store"))
      for (const auto& e : fs::recursive_directory_iterator(dir_ / "store")) files += e.is_regular_file();
    return files == 0;
  };

  grpc::Status bad = Upload(dir_ / "ours", port_, "a", "a", "job-1", "weights/stage-1.safetensors", data, 1 << 20,
                            std::string(64, '0'));
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::DATA_LOSS);
  EXPECT_THAT(bad.error_message(), HasSubstr("SHA-256 mismatch"));
  EXPECT_THAT(bad.error_message(), HasSubstr("site 'a'"));
  EXPECT_TRUE(nothing_left());
  grpc::Status cut =
      Upload(dir_ / "ours", port_, "a", "a", "job-1", "weights/stage-1.safetensors", data, 1 << 20, "none");
  EXPECT_EQ(cut.error_code(), grpc::StatusCode::DATA_LOSS);
  EXPECT_TRUE(nothing_left());
  grpc::Status stale = Upload(dir_ / "ours", port_, "a", "a", "job-0", "weights/stage-1.safetensors", data, 1 << 20);
  EXPECT_EQ(stale.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(nothing_left());
  grpc::Status big = Upload(dir_ / "ours", port_, "a", "a", "job-1", "weights/stage-1.safetensors", data, 5 << 20);
  EXPECT_NE(big.error_code(), grpc::StatusCode::OK);  // over the 4 MiB chunk bound (or the 8 MiB message limit)
  EXPECT_TRUE(nothing_left());
  grpc::Status large = Upload(dir_ / "ours", port_, "a", "a", "job-1", "weights/stage-1.safetensors",
                              data + std::string(3 * 1000 * 1000, 'x'), 1 << 20);
  EXPECT_EQ(large.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);  // over the 12 MB the handler grants
  EXPECT_TRUE(nothing_left());
  grpc::Status not_a_writer =
      Upload(dir_ / "ours", port_, "b", "b", "job-1", "weights/stage-1.safetensors", data, 1 << 20);
  EXPECT_EQ(not_a_writer.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(nothing_left());

  const int before = handler_.calls.load();
  for (const char* path : {"../escape", "weights/../../escape", "/etc/passwd", "weights/stage-1.safetensors.x",
                           "checkpoints/step-1/../stage-0.json", "checkpoints/x/stage-0.json", ""}) {
    grpc::Status s = Upload(dir_ / "ours", port_, "a", "a", "job-1", path, "x", 1);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << path;
  }
  // The certificate of site b cannot send as site a.
  grpc::Status other = Upload(dir_ / "ours", port_, "b", "a", "job-1", "weights/stage-1.safetensors", "x", 1);
  EXPECT_EQ(other.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(handler_.calls.load(), before);
  EXPECT_TRUE(nothing_left());
}

// A site fetches a checkpoint file back: the same bytes with their SHA-256; only checkpoint paths, only
// files the coordinator has, only as itself.
TEST_F(CoordinatorAuthTest, GetFileReturnsAStoredCheckpointFile) {
  std::string data(3 * 1000 * 1000 + 11, '\0');
  std::mt19937 rng(6);
  for (auto& c : data) c = static_cast<char>(rng());
  const std::string path = "checkpoints/step-4/stage-1.safetensors";
  ASSERT_TRUE(Upload(dir_ / "ours", port_, "a", "a", "job-1", path, data, 1 << 20).ok());
  auto fetch = [&](const std::string& site, const std::string& claimed, const std::string& p, std::string* out,
                   std::string* sha) {
    auto creds = MakeChannelCredentials((dir_ / "ours").string(), site);
    auto stub = v1::Coordinator::NewStub(
        grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port_), *creds, PeerChannelArguments("coordinator")));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::FileRequest req;
    req.set_site(claimed);
    req.set_path(p);
    auto reader = stub->GetFile(&ctx, req);
    v1::FileChunk c;
    while (reader->Read(&c)) {
      *out += c.data();
      if (!c.sha256().empty()) *sha = c.sha256();
    }
    return reader->Finish();
  };
  std::string got, sha;
  grpc::Status s = fetch("b", "b", path, &got, &sha);  // any site of the cluster may fetch
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(got == data) << got.size() << " bytes";
  unsigned char d[EVP_MAX_MD_SIZE];
  unsigned n = 0;
  EVP_Digest(data.data(), data.size(), d, &n, EVP_sha256(), nullptr);
  std::ostringstream hex;
  for (unsigned i = 0; i < n; ++i) hex << std::hex << (d[i] >> 4) << (d[i] & 15);
  EXPECT_EQ(sha, hex.str());
  got.clear();
  EXPECT_EQ(fetch("b", "b", "checkpoints/step-5/stage-1.safetensors", &got, &sha).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(fetch("b", "b", "weights/stage-1.safetensors", &got, &sha).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(fetch("b", "b", "checkpoints/step-4/../../x", &got, &sha).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(fetch("b", "a", path, &got, &sha).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(got.empty());
}

}  // namespace
}  // namespace meridian::rpc

namespace meridian::rpc {
namespace {

// Exercises one CoordinatorClient the way an executor does: register, a command, a report, a checkpoint
// file up and back down, a refused path, a refused attempt.
void UseAsAnExecutorWould(CoordinatorClient* client, const fs::path& dir) {
  v1::RegisterRequest reg;
  reg.set_site("a");
  reg.set_protocol_version(kProtocolVersion);
  auto joined = client->Register(reg, std::chrono::seconds(5));
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_EQ(joined->run_id(), "run-1");
  auto stream = client->Commands("a");
  v1::Command command;
  ASSERT_TRUE(stream->Next(&command));
  EXPECT_TRUE(command.has_stop());
  stream->Cancel();
  v1::StageDone done;
  done.set_site("a");
  EXPECT_TRUE(client->ReportDone(done, std::chrono::seconds(5)).ok());

  const fs::path local = dir / "shard.bin";
  std::string data(3 * 1000 * 1000 + 17, '\0');  // several chunks
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 31 % 251);
  std::ofstream(local, std::ios::binary) << data;
  ASSERT_TRUE(client->PutFile("a", "job-1", local.string(), "checkpoints/step-4/stage-0.safetensors").ok());
  const fs::path back = dir / "fetched" / "stage-0.safetensors";
  absl::Status got = client->GetFile("a", "checkpoints/step-4/stage-0.safetensors", back.string());
  ASSERT_TRUE(got.ok()) << got;
  std::ifstream in(back, std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), data);

  EXPECT_EQ(client->PutFile("a", "job-1", local.string(), "../escape.bin").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->PutFile("a", "job-0", local.string(), "weights/stage-0.safetensors").code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(client->GetFile("a", "weights/stage-0.safetensors", back.string()).code(),
            absl::StatusCode::kInvalidArgument);  // sites fetch checkpoints only
  EXPECT_EQ(client->GetFile("a", "checkpoints/step-9/stage-0.json", back.string()).code(), absl::StatusCode::kNotFound);
}

// A site that begins uploads and sends nothing more cannot hold its upload slots: each is ended after the
// idle timeout, leaves no file, and the site's next upload is served.
TEST_F(CoordinatorAuthTest, StalledUploadsAreEndedAndFreeTheirSlots) {
  service_->set_upload_idle_timeout(std::chrono::milliseconds(500));
  auto creds = MakeChannelCredentials((dir_ / "ours").string(), "a");
  ASSERT_TRUE(creds.ok());
  auto stub = v1::Coordinator::NewStub(
      grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port_), *creds, PeerChannelArguments("coordinator")));
  struct Stalled {
    grpc::ClientContext ctx;
    v1::FileAck ack;
    std::unique_ptr<grpc::ClientWriter<v1::FileChunk>> writer;
  };
  std::vector<std::unique_ptr<Stalled>> stalled;
  for (int i = 0; i < CoordinatorService::kUploadsPerSite; ++i) {
    auto s = std::make_unique<Stalled>();
    s->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    s->writer = stub->PutFile(&s->ctx, &s->ack);
    v1::FileChunk c;
    c.set_site("a");
    c.set_job_id("job-1");
    c.set_path("checkpoints/step-4/stage-" + std::to_string(i) + ".safetensors");
    c.set_data(std::string(1000, 'x'));
    ASSERT_TRUE(s->writer->Write(c));
    stalled.push_back(std::move(s));
  }
  for (auto& s : stalled) EXPECT_EQ(s->writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // The client may hear of the cancellation before the handler has removed its partial file.
  auto files = [&] {
    int n = 0;
    for (const auto& e : fs::recursive_directory_iterator(dir_ / "store")) n += e.is_regular_file();
    return n;
  };
  for (int i = 0; i < 100 && files() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(files(), 0);  // no stored file, no partial file either
  v1::FileAck ack;
  grpc::Status next =
      Upload(dir_ / "ours", port_, "a", "a", "job-1", "checkpoints/step-4/stage-0.safetensors", "data", 4, "", &ack);
  EXPECT_TRUE(next.ok()) << next.error_message();
}

// A coordinator that sends one chunk of a file and then nothing: the client gives up after its idle
// timeout, not after a deadline guessed from the size.
class StallingService final : public v1::Coordinator::Service {
 public:
  grpc::Status GetFile(grpc::ServerContext* ctx, const v1::FileRequest*,
                       grpc::ServerWriter<v1::FileChunk>* writer) override {
    v1::FileChunk c;
    c.set_data(std::string(1000, 'x'));
    writer->Write(c);
    for (int i = 0; i < 300 && !ctx->IsCancelled(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    return grpc::Status::OK;
  }
};

TEST_F(CoordinatorAuthTest, AFetchThatStopsMakingProgressFailsAfterTheIdleTimeout) {
  StallingService stalling;
  grpc::ServerBuilder builder;
  ConfigureServer(&builder);
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", *MakeServerCredentials((dir_ / "ours").string(), "coordinator"), &port);
  builder.RegisterService(&stalling);
  auto server = builder.BuildAndStart();
  ASSERT_TRUE(server);
  auto client = ConnectCoordinator((dir_ / "ours").string(), "a", "127.0.0.1:" + std::to_string(port),
                                   std::chrono::milliseconds(700));
  ASSERT_TRUE(client.ok());
  absl::Status s = (*client)->GetFile("a", "checkpoints/step-4/stage-0.safetensors", (dir_ / "got").string());
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("no progress for"));
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

TEST_F(CoordinatorAuthTest, TheGrpcCoordinatorClientServesAnExecutor) {
  auto client = ConnectCoordinator((dir_ / "ours").string(), "a", "127.0.0.1:" + std::to_string(port_));
  ASSERT_TRUE(client.ok()) << client.status();
  UseAsAnExecutorWould(client->get(), dir_);
}

TEST(CoordinatorClient, TheInProcessClientServesAnExecutorWithoutANetwork) {
  const fs::path dir = fs::temp_directory_path() / ("meridian_inproc_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  CountingHandler handler;
  handler.store = (dir / "store").string();
  auto client = InProcessCoordinatorClient(&handler);
  UseAsAnExecutorWould(client.get(), dir);
  EXPECT_GT(handler.calls.load(), 5);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace meridian::rpc

namespace meridian::rpc {
namespace {

// A handler with no command to give: streams stay open.
class IdleHandler : public CountingHandler {
 public:
  absl::StatusOr<std::optional<v1::Command>> NextCommand(const std::string&, std::chrono::milliseconds t) override {
    std::this_thread::sleep_for(std::min(t, std::chrono::milliseconds(50)));
    return std::optional<v1::Command>();
  }
};

// A hostile site opening command streams without end holds one: each newer stream supersedes the one
// before, and the coordinator keeps answering everyone.
TEST_F(CoordinatorAuthTest, ASiteOpeningManyCommandStreamsHoldsOne) {
  IdleHandler idle;
  CoordinatorService service(std::set<std::string>{"a", "b"}, &idle);
  grpc::ServerBuilder builder;
  ConfigureServer(&builder, ServerThreadsFor(2, CoordinatorService::kStreamsPerSite));  // as `meridian run` does
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", *MakeServerCredentials((dir_ / "ours").string(), "coordinator"), &port);
  builder.RegisterService(&service);
  auto server = builder.BuildAndStart();
  ASSERT_TRUE(server);
  const std::string address = "127.0.0.1:" + std::to_string(port);
  // Raw streams. Under load the server may start their handlers in any order and late, so: open 1,000,
  // wait until the service has seen all it will, then open one more, which supersedes whichever was held.
  // With the thread cap, streams that find every thread busy are refused by gRPC (ResourceExhausted)
  // rather than queued; the others reach the service and are superseded.
  auto creds = MakeChannelCredentials((dir_ / "ours").string(), "a");
  ASSERT_TRUE(creds.ok());
  auto stub = v1::Coordinator::NewStub(grpc::CreateCustomChannel(address, *creds, PeerChannelArguments("coordinator")));
  struct Open {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<v1::Command>> reader;
  };
  v1::CommandStreamRequest req;
  req.set_site("a");
  auto open = [&] {
    auto o = std::make_unique<Open>();
    o->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(240));
    o->reader = stub->Commands(&o->ctx, req);
    return o;
  };
  std::vector<std::unique_ptr<Open>> streams;
  for (int i = 0; i < 1000; ++i) streams.push_back(open());
  for (int i = 0, quiet = 0; i < 1200 && service.handled_calls() < 1000 && quiet < 10; ++i) {
    const int64_t before = service.handled_calls();
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    quiet = service.handled_calls() == before ? quiet + 1 : 0;
  }
  std::this_thread::sleep_for(std::chrono::seconds(1));  // each registers its stream just after that count
  auto last = open();
  int superseded = 0, refused = 0;
  for (auto& o : streams) {
    v1::Command c;
    EXPECT_FALSE(o->reader->Read(&c));
    const grpc::Status s = o->reader->Finish();
    superseded += s.error_code() == grpc::StatusCode::CANCELLED;
    refused += s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
  }
  EXPECT_EQ(superseded + refused, 1000) << superseded << " superseded, " << refused << " refused";
  std::cout << superseded << " superseded, " << refused << " refused by the thread cap\n";
  EXPECT_GE(superseded, 1);
  EXPECT_LE(service.handled_calls(), 1001);
  last->ctx.TryCancel();
  (void)last->reader->Finish();
  // The other site is still served.
  auto other = ConnectCoordinator((dir_ / "ours").string(), "b", address);
  ASSERT_TRUE(other.ok());
  v1::HeartbeatRequest hb;
  hb.set_site("b");
  EXPECT_TRUE((*other)->Heartbeat(hb, std::chrono::seconds(10)).ok());
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

}  // namespace
}  // namespace meridian::rpc
