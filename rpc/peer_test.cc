// Peer tensor streams over real mutual-TLS gRPC on loopback, in one process.
#include "rpc/peer.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cctype>
#include <filesystem>
#include <future>
#include <random>
#include <sstream>
#include <thread>

#include "compression/codec.h"
#include "core/certs.h"
#include "rpc/credentials.h"
#include "tests/test_util.h"

namespace meridian::rpc {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

class PeerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(fs::temp_directory_path() / ("meridian_peer_" + std::to_string(::getpid())));
    fs::remove_all(*dir_);
    core::ClusterSpec spec;
    spec.name = "t";
    spec.coordinator = {"127.0.0.1", 1};
    for (const char* s : {"a", "b", "c"}) spec.sites.push_back({s, {"127.0.0.1", 2}});
    std::vector<std::string> w;
    ASSERT_TRUE(core::InitClusterCerts(spec, dir_->string(), {}, &w).ok());
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }
  // Starts b's peer service, accepting streams from a only.
  void StartServer() {
    service_ = std::make_unique<PeerService>("b", std::set<std::string>{"a"}, &inbox_);
    grpc::ServerBuilder builder;
    ConfigureServer(&builder);
    builder.AddListeningPort("127.0.0.1:0", *MakeServerCredentials(dir_->string(), "b"), &port_);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_TRUE(server_);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }
  std::unique_ptr<PeerClient> Client(const std::string& self) {
    return *PeerClient::Create(dir_->string(), self, "b", "127.0.0.1:" + std::to_string(port_));
  }
  static std::vector<uint8_t> Frame(size_t n, const char* codec = "int8") {
    std::vector<float> x(n);
    std::mt19937 rng(n);
    std::normal_distribution<float> g;
    for (auto& v : x) v = g(rng);
    return *compression::Encode({core::DType::kFloat32, {static_cast<int64_t>(n)}, x.data()},
                                *compression::CodecSpec::Parse(codec));
  }
  static fs::path* dir_;
  TensorInbox inbox_;
  std::unique_ptr<PeerService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};
fs::path* PeerTest::dir_ = nullptr;

// A port in use fails to bind, naming the address, instead of sharing the port (gRPC's default
// SO_REUSEPORT would let both servers bind and split the connections between them).
TEST_F(PeerTest, APortInUseFailsToBindNamingTheAddress) {
  StartServer();
  const std::string address = "127.0.0.1:" + std::to_string(port_);
  PeerService other("b", std::set<std::string>{"a"}, &inbox_);
  auto second = StartMtlsServer(dir_->string(), "b", address, {&other});
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(second.status().message()), HasSubstr(address));
}

TEST_F(PeerTest, FramesArriveByKeyIntact) {
  StartServer();
  auto client = Client("a");
  auto stream = client->OpenStream(std::chrono::seconds(30));
  ASSERT_TRUE(stream.ok()) << stream.status();
  std::vector<std::vector<uint8_t>> sent;
  for (int mb = 0; mb < 4; ++mb) {
    sent.push_back(Frame(100000 + mb * 7919));  // several chunks each for the larger codecs
    TensorKey k{"job", 3, mb, 0, v1::FORWARD, 0};
    ASSERT_TRUE((*stream)->Send(k, sent.back()).ok());
  }
  auto big = Frame(3 << 20, "identity");  // 12 MiB: 12 chunks
  ASSERT_TRUE((*stream)->Send({"job", 3, 9, 0, v1::BACKWARD, 1}, big).ok());
  auto acked = (*stream)->Finish();
  ASSERT_TRUE(acked.ok()) << acked.status();
  EXPECT_EQ(*acked, 5);
  for (int mb = 3; mb >= 0; --mb) {
    auto f = inbox_.Wait("a", {"job", 3, mb, 0, v1::FORWARD, 0}, Clock::now() + std::chrono::seconds(5));
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(*f, sent[mb]);
  }
  auto f = inbox_.Wait("a", {"job", 3, 9, 0, v1::BACKWARD, 1}, Clock::now() + std::chrono::seconds(5));
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(*f, big);
  EXPECT_EQ(inbox_.pending(), 0u);
}

TEST_F(PeerTest, OneGibTensorStreamsInChunks) {
  StartServer();
  auto client = Client("a");
  const size_t n = 256u << 20;  // 1 GiB of float32
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(i % 1000003);
  auto frame = compression::Encode({core::DType::kFloat32, {static_cast<int64_t>(n)}, x.data()},
                                   *compression::CodecSpec::Parse("identity"));
  ASSERT_TRUE(frame.ok());
  x = {};
  x.shrink_to_fit();
  auto stream = client->OpenStream(std::chrono::seconds(120));
  ASSERT_TRUE(stream.ok());
  ASSERT_TRUE((*stream)->Send({"job", 1, 0, 0, v1::FORWARD, 0}, *frame).ok());
  ASSERT_TRUE((*stream)->Finish().ok());
  auto got = inbox_.Wait("a", {"job", 1, 0, 0, v1::FORWARD, 0}, Clock::now() + std::chrono::seconds(60));
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), frame->size());
  auto t = compression::Decode(got->data(), got->size(), {int64_t{1} << 28});
  ASSERT_TRUE(t.ok()) << t.status();  // the frame's checksum covers all 1 GiB
  EXPECT_EQ(t->data<float>()[n - 1], static_cast<float>((n - 1) % 1000003));
}

TEST_F(PeerTest, UnauthorisedSiteIsRejectedBeforeAnyHandlerRuns) {
  StartServer();
  auto client = Client("c");  // a valid certificate of the cluster, but not b's neighbour
  auto rtt = client->EchoSeconds(8, std::chrono::milliseconds(5000));
  ASSERT_FALSE(rtt.ok());
  EXPECT_EQ(rtt.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(rtt.status().message()), HasSubstr("'c' may not stream tensors to 'b'"));
  auto stream = client->OpenStream(std::chrono::seconds(5));
  ASSERT_TRUE(stream.ok());
  absl::Status s = (*stream)->Send({"job", 0, 0, 0, v1::FORWARD, 0}, Frame(1000));
  if (s.ok()) s = (*stream)->Finish().status();
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(service_->authorised_calls(), 0);
  EXPECT_EQ(service_->bytes_received(), 0);
}

TEST_F(PeerTest, CorruptFrameFailsTheStreamNamingThePeer) {
  StartServer();
  auto client = Client("a");
  auto stream = client->OpenStream(std::chrono::seconds(10));
  auto f = Frame(5000);
  f[f.size() / 2] ^= 0xff;
  absl::Status s = (*stream)->Send({"job", 0, 1, 0, v1::FORWARD, 0}, f);
  if (s.ok()) s = (*stream)->Finish().status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr("peer 'a' sent a corrupt frame"));
  auto w = inbox_.Wait("a", {"job", 0, 2, 0, v1::FORWARD, 0}, Clock::now() + std::chrono::seconds(5));
  EXPECT_EQ(w.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(w.status().message()), HasSubstr("peer 'a' failed"));
}

TEST_F(PeerTest, SenderCutOffMidStreamFailsWaitersWithinTheDeadline) {
  StartServer();
  auto client = Client("a");
  {
    auto stream = client->OpenStream(std::chrono::seconds(10));
    ASSERT_TRUE((*stream)->Send({"job", 0, 0, 0, v1::FORWARD, 0}, Frame(1000)).ok());
    // Destroyed without Finish: the RPC is cancelled, as when the sending process dies.
  }
  auto t0 = Clock::now();
  auto w = inbox_.Wait("a", {"job", 0, 5, 0, v1::FORWARD, 0}, Clock::now() + std::chrono::seconds(10));
  EXPECT_EQ(w.status().code(), absl::StatusCode::kUnavailable) << w.status();
  EXPECT_THAT(std::string(w.status().message()), HasSubstr("peer 'a'"));
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(10));
}

// A sender that cancels a stream on which it sent no tensor -- one of an earlier attempt's, closed after a
// switch -- loses nothing: the waits for the tensors its peer sends on its other stream go on and get them.
// (A CI run failed when such a stream, cut off, failed the new attempt's replica sync.)
TEST_F(PeerTest, AnEmptyStreamCutOffFailsNoWait) {
  StartServer();
  auto client = Client("a");
  auto current = client->OpenStream(std::chrono::seconds(10));
  ASSERT_TRUE(current.ok());
  ASSERT_TRUE((*current)->Send({"job-1", 0, 0, 0, v1::REPLICA_GRADIENT, 0}, Frame(1000)).ok());
  ASSERT_TRUE(
      inbox_.Wait("a", {"job-1", 0, 0, 0, v1::REPLICA_GRADIENT, 0}, Clock::now() + std::chrono::seconds(5)).ok());
  {
    auto stale = client->OpenStream(std::chrono::seconds(10));
    ASSERT_TRUE(stale.ok());
    // Destroyed without Finish and without a tensor sent: cancelled.
  }
  // The cut-off reaches the service on its own thread: a wait then is where a wrong failure would show.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ASSERT_TRUE((*current)->Send({"job-1", 0, 1, 0, v1::REPLICA_GRADIENT, 0}, Frame(1000)).ok());
  auto w = inbox_.Wait("a", {"job-1", 0, 1, 0, v1::REPLICA_GRADIENT, 0}, Clock::now() + std::chrono::seconds(5));
  EXPECT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE((*current)->Finish().ok());
}

// A stream on which a peer sent no tensor, cut off while it is the peer's only stream, fails the waits of
// the attempt it opened in -- never those of a later one. A CI run failed when such a stream of the first
// attempt, cut off between the attempts, failed the next attempt's outer exchange before the peer's new
// streams had opened.
TEST_F(PeerTest, AnEmptyStreamCutOffFailsOnlyTheAttemptItOpenedIn) {
  StartServer();
  auto client = Client("a");
  const TensorKey first{"attempt-1", 0, 0, 0, v1::REPLICA_GRADIENT, 0};
  const TensorKey second{"attempt-2", 0, 0, 0, v1::REPLICA_GRADIENT, 0};
  auto cut_off_empty_stream = [&] {
    auto stale = client->OpenStream(std::chrono::seconds(10));
    ASSERT_TRUE(stale.ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the service has seen it open
  };  // destroyed without Finish and without a tensor sent: cancelled
  auto failed = [&](const TensorKey& key) {
    auto w = inbox_.Wait("a", key, Clock::now() + std::chrono::milliseconds(500));
    EXPECT_FALSE(w.ok());
    return w.status().code() == absl::StatusCode::kUnavailable;
  };

  // Within an attempt: its process may have died before its first chunk; the attempt's waits fail.
  service_->SetJob(std::string("attempt-1"));
  cut_off_empty_stream();
  EXPECT_TRUE(failed(first));
  // Between the attempts (no job named): every job's waits fail, until the next attempt begins.
  service_->SetJob(std::nullopt);
  cut_off_empty_stream();
  EXPECT_TRUE(failed(second));
  service_->SetJob(std::string("attempt-2"));
  EXPECT_FALSE(failed(second));  // DeadlineExceeded: waiting, not failed
  // Opened in attempt 2 and cut off after attempt 3 began: attempt 3's waits go on.
  {
    auto stale = client->OpenStream(std::chrono::seconds(10));
    ASSERT_TRUE(stale.ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    service_->SetJob(std::string("attempt-3"));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the cut-off reaches the service
  EXPECT_FALSE(failed({"attempt-3", 0, 0, 0, v1::REPLICA_GRADIENT, 0}));
  // And the peer's tensors of the new attempt arrive.
  auto current = client->OpenStream(std::chrono::seconds(10));
  ASSERT_TRUE(current.ok());
  ASSERT_TRUE((*current)->Send({"attempt-3", 0, 0, 0, v1::REPLICA_GRADIENT, 0}, Frame(1000)).ok());
  EXPECT_TRUE(
      inbox_.Wait("a", {"attempt-3", 0, 0, 0, v1::REPLICA_GRADIENT, 0}, Clock::now() + std::chrono::seconds(5)).ok());
  EXPECT_TRUE((*current)->Finish().ok());
}

// A late failure of an abandoned attempt's stream leaves the current attempt's failure of the same peer
// in place, and fails no wait of the current attempt by itself.
TEST(TensorInboxTest, EachJobsFailureOfAPeerIsKeptApart) {
  TensorInbox inbox;
  const TensorKey current{"attempt-2", 0, 0, 0, v1::FORWARD, 0}, other{"attempt-3", 0, 0, 0, v1::FORWARD, 0};
  inbox.FailPeer("a", "its attempt-1 stream was cut off", "attempt-1");
  auto w = inbox.Wait("a", current, Clock::now() + std::chrono::milliseconds(100));
  EXPECT_EQ(w.status().code(), absl::StatusCode::kDeadlineExceeded) << w.status();
  inbox.FailPeer("a", "its attempt-2 stream was cut off", "attempt-2");
  inbox.FailPeer("a", "its attempt-1 stream broke again", "attempt-1");  // late: must not replace attempt 2's
  w = inbox.Wait("a", current, Clock::now() + std::chrono::seconds(5));
  EXPECT_EQ(w.status().code(), absl::StatusCode::kUnavailable) << w.status();
  EXPECT_THAT(std::string(w.status().message()), HasSubstr("its attempt-2 stream was cut off"));
  w = inbox.Wait("b", current, Clock::now() + std::chrono::milliseconds(100));  // another peer: not failed
  EXPECT_EQ(w.status().code(), absl::StatusCode::kDeadlineExceeded) << w.status();
  inbox.DropOtherJobs("attempt-3");  // a new attempt forgets both
  w = inbox.Wait("a", other, Clock::now() + std::chrono::milliseconds(100));
  EXPECT_EQ(w.status().code(), absl::StatusCode::kDeadlineExceeded) << w.status();
  inbox.FailPeer("a", "every job", "");
  w = inbox.Wait("a", other, Clock::now() + std::chrono::seconds(5));
  EXPECT_EQ(w.status().code(), absl::StatusCode::kUnavailable) << w.status();
  inbox.ClearPeer("a");  // it reconnected
  w = inbox.Wait("a", other, Clock::now() + std::chrono::milliseconds(100));
  EXPECT_EQ(w.status().code(), absl::StatusCode::kDeadlineExceeded) << w.status();
}

// A frame whose key is already waiting replaces the waiting one, and is counted and named; one delivered
// after the first was taken is not a replacement.
TEST(TensorInboxTest, AFrameReplacingOneNotYetTakenIsCountedAndNamed) {
  TensorInbox inbox;
  const TensorKey key{"job", 7, 1, 0, v1::REPLICA_GRADIENT, 0};
  ASSERT_TRUE(inbox.Deliver("a", key, {1, 2, 3}).ok());
  ASSERT_TRUE(inbox.Deliver("b", key, {9}).ok());  // another peer: its own frame
  EXPECT_EQ(inbox.replaced(), 0);
  EXPECT_EQ(inbox.last_replaced(), "");
  ASSERT_TRUE(inbox.Deliver("a", key, {4, 5}).ok());
  EXPECT_EQ(inbox.replaced(), 1);
  EXPECT_THAT(inbox.last_replaced(), HasSubstr("peer 'a'"));
  EXPECT_THAT(inbox.last_replaced(), HasSubstr("step 7"));
  auto got = inbox.Wait("a", key, Clock::now() + std::chrono::seconds(5));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, (std::vector<uint8_t>{4, 5}));   // the newest
  ASSERT_TRUE(inbox.Deliver("a", key, {6}).ok());  // taken before: a new frame, not a replacement
  EXPECT_EQ(inbox.replaced(), 1);
}

// A peer naming jobs of its own (no SetJob: static mode) cannot grow the failure marks without bound: the
// newest job's mark and the every-job mark stay.
TEST(TensorInboxTest, APeersFailureMarksAreBounded) {
  TensorInbox inbox;
  inbox.FailPeer("a", "every job", "");
  for (int i = 0; i < 1000; ++i) inbox.FailPeer("a", "made-up job " + std::to_string(i), "job-" + std::to_string(i));
  EXPECT_LE(inbox.failures(), static_cast<size_t>(TensorInbox::kMaxFailuresPerPeer));
  auto w = inbox.Wait("a", {"job-999", 0, 0, 0, v1::FORWARD, 0}, Clock::now() + std::chrono::seconds(5));
  EXPECT_THAT(std::string(w.status().message()), HasSubstr("made-up job 999"));
  w = inbox.Wait("a", {"job-0", 0, 0, 0, v1::FORWARD, 0}, Clock::now() + std::chrono::seconds(5));
  EXPECT_THAT(std::string(w.status().message()), HasSubstr("every job"));  // its own mark went; this stays
}

// With an attempt named (SetJob), a stream that carried another job's frames and is cut off marks no
// failure: nobody waits for that job, and a hostile peer would otherwise add a mark per made-up job.
TEST_F(PeerTest, AStreamOfAnotherJobCutOffMarksNoFailure) {
  StartServer();
  service_->SetJob(std::string("attempt-2"));
  auto client = Client("a");
  for (int i = 0; i < 3; ++i) {
    auto stream = client->OpenStream(std::chrono::seconds(10));
    ASSERT_TRUE(stream.ok());
    ASSERT_TRUE((*stream)->Send({"made-up-" + std::to_string(i), 0, 0, 0, v1::FORWARD, 0}, Frame(1000)).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // received (and dropped) before the cut-off
  }                                                               // each destroyed without Finish: cancelled
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(inbox_.failures(), 0u);
  EXPECT_EQ(service_->dropped_frames(), 3);
}

TEST_F(PeerTest, ReceiverGoneFailsTheSenderNamingIt) {
  StartServer();
  auto client = Client("a");
  auto stream = client->OpenStream(std::chrono::seconds(10));
  ASSERT_TRUE((*stream)->Send({"job", 0, 0, 0, v1::FORWARD, 0}, Frame(1000)).ok());
  server_->Shutdown(std::chrono::system_clock::now());
  server_.reset();
  absl::Status s;
  auto big = Frame(1 << 20, "identity");
  for (int i = 0; i < 50 && s.ok(); ++i) s = (*stream)->Send({"job", 0, i + 1, 0, v1::FORWARD, 0}, big);
  if (s.ok()) s = (*stream)->Finish().status();
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("peer 'b'"));
}

TEST_F(PeerTest, InboxDeadlineNamesPeerAndKey) {
  auto w = inbox_.Wait("a", {"job", 7, 2, 1, v1::BACKWARD, 0}, Clock::now() + std::chrono::milliseconds(50));
  EXPECT_EQ(w.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(w.status().message()), HasSubstr("step 7 micro-batch 2 stage 1 BACKWARD"));
  EXPECT_THAT(std::string(w.status().message()), HasSubstr("peer 'a'"));
}

TEST_F(PeerTest, ProbeMeasuresLoopback) {
  StartServer();
  auto client = Client("a");
  ProbeOptions o;
  o.bulk_bytes = 16 << 20;
  auto m = ProbeLink(*client, o);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_GT(m->rtt_seconds, 0);
  EXPECT_LT(m->rtt_seconds, 0.05);
  EXPECT_GT(m->forward_bytes_per_second, 50e6);  // loopback TLS: far above any WAN
  EXPECT_GT(m->reverse_bytes_per_second, 50e6);
  // Neither end measured what receiving costs it: no share of a core given.
  EXPECT_EQ(m->forward_receive_seconds_per_byte, 0);
  EXPECT_EQ(m->reverse_receive_seconds_per_byte, 0);
}

// b's peer service whose first `resets` bulk streams are cut off with `code`, as a stream reset by the
// transport reaches the prober (CI saw "Received RST_STREAM with error code 1", INTERNAL); every other
// call is the real service's.
class CutsOffStreams final : public v1::Peer::Service {
 public:
  CutsOffStreams(PeerService* real, int resets, grpc::StatusCode code) : real_(real), resets_(resets), code_(code) {}
  grpc::Status Stream(grpc::ServerContext* ctx, grpc::ServerReader<v1::TensorChunk>* reader,
                      v1::StreamAck* ack) override {
    if (resets_-- > 0) return grpc::Status(code_, "cut off");
    return real_->Stream(ctx, reader, ack);
  }
  grpc::Status Echo(grpc::ServerContext* ctx, const v1::Ping* req, v1::Ping* resp) override {
    return real_->Echo(ctx, req, resp);
  }
  grpc::Status Pull(grpc::ServerContext* ctx, const v1::PullRequest* req,
                    grpc::ServerWriter<v1::TensorChunk>* writer) override {
    return real_->Pull(ctx, req, writer);
  }

 private:
  PeerService* real_;
  std::atomic<int> resets_;
  const grpc::StatusCode code_;
};

// A probe cut off by the transport is measured again, at most ProbeOptions::attempts times in all, and
// says so; an error of the peer's answer (here a refused identity) is not retried.
TEST_F(PeerTest, AProbeCutOffByTheTransportIsMeasuredAgainOnce) {
  PeerService real("b", std::set<std::string>{"a"}, &inbox_);
  auto probe = [&](int resets, grpc::StatusCode code, int attempts) {
    CutsOffStreams service(&real, resets, code);
    int port = 0;
    auto server = StartMtlsServer(dir_->string(), "b", "127.0.0.1:0", {&service}, &port);
    EXPECT_TRUE(server.ok()) << server.status();
    auto client = *PeerClient::Create(dir_->string(), "a", "b", "127.0.0.1:" + std::to_string(port));
    ProbeOptions o;
    o.bulk_bytes = 1 << 20;
    o.pings = 3;
    o.attempts = attempts;
    auto m = ProbeLink(*client, o);
    (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    return m;
  };
  for (grpc::StatusCode code :
       {grpc::StatusCode::INTERNAL, grpc::StatusCode::UNAVAILABLE, grpc::StatusCode::RESOURCE_EXHAUSTED}) {
    auto m = probe(1, code, 2);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_GT(m->forward_bytes_per_second, 0);
    EXPECT_GT(m->reverse_bytes_per_second, 0);
    ASSERT_EQ(m->retried_after.size(), 1u);
    EXPECT_THAT(m->retried_after[0], HasSubstr("cut off"));
  }
  // Cut off twice: the second error is the probe's, and it names the first. (Which call of the stream
  // hears of the cut -- a send or its end -- depends on when the service's answer arrives, so the
  // messages' prefixes vary; both end with the service's words.)
  auto twice = probe(2, grpc::StatusCode::INTERNAL, 2);
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(twice.status().message()),
              ::testing::MatchesRegex(".*: cut off \\(measured 2 times; the first cut off: .*: cut off\\)"));
  // One attempt only: none again.
  EXPECT_EQ(probe(1, grpc::StatusCode::INTERNAL, 1).status().code(), absl::StatusCode::kInternal);
  // Not the transport: failed at once (the next stream would have been the real service's).
  EXPECT_EQ(probe(1, grpc::StatusCode::PERMISSION_DENIED, 2).status().code(), absl::StatusCode::kPermissionDenied);
  // A first attempt that completes retries nothing.
  auto clean = probe(0, grpc::StatusCode::INTERNAL, 2);
  ASSERT_TRUE(clean.ok()) << clean.status();
  EXPECT_TRUE(clean->retried_after.empty());
}

// What receiving costs per byte at the link's rate: the peer's service reports its CPU for a probe
// stream once it is given its share of a core (here the process's, both ends: above nothing, below 1 us
// a byte; loopback TLS here: a few ns a byte), and the reverse direction, where the two directions' rates
// are within 1.5x, is priced at the same CPU a byte at the prober's share: half the share, twice the
// seconds. (On a loaded machine loopback's two directions can read further apart, each the best of the
// repeats: then the reverse direction has no figure, as ProbeLink specifies.)
TEST_F(PeerTest, AProbeMeasuresWhatReceivingCostsAtBothEnds) {
  StartServer();
  service_->SetProbeCpuShare(0.5);
  auto client = Client("a");
  ProbeOptions o;
  o.bulk_bytes = 8 << 20;
  o.repeats = 3;
  o.cpu_share = 0.25;
  auto m = ProbeLink(*client, o);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_GT(m->forward_receive_seconds_per_byte, 0);
  EXPECT_LT(m->forward_receive_seconds_per_byte, 1e-6);
  const double fwd = m->forward_bytes_per_second, rev = m->reverse_bytes_per_second;
  if (std::max(fwd, rev) <= 1.5 * std::min(fwd, rev))
    EXPECT_NEAR(m->reverse_receive_seconds_per_byte, 2 * m->forward_receive_seconds_per_byte,
                1e-9 * m->forward_receive_seconds_per_byte);
  else
    EXPECT_EQ(m->reverse_receive_seconds_per_byte, 0) << "rates " << fwd << " and " << rev << " B/s";
  // A service that stops measuring (its site computes or trains) reports nothing again, and without the
  // peer's figure the reverse direction has none either.
  service_->SetProbeCpuShare(0);
  auto again = ProbeLink(*client, o);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->forward_receive_seconds_per_byte, 0);
  EXPECT_EQ(again->reverse_receive_seconds_per_byte, 0);
}

// For each connection established from this host to `port`, the bytes its client side has received,
// read with iproute2's ss (which the emulated WAN needs anyway).
static std::vector<int64_t> BytesReceivedOnConnectionsTo(int port) {
  const auto [rc, text] =
      meridian::testing::Shell("ss -tinH state established '( dport = :" + std::to_string(port) + " )'");
  EXPECT_EQ(rc, 0) << text;
  // Each socket: a line with its queues and addresses, then an indented one with its TCP_INFO
  // (bytes_received:N once it has received any).
  std::vector<int64_t> out;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty()) continue;
    if (!std::isspace(static_cast<unsigned char>(line[0]))) {
      out.push_back(0);
    } else if (!out.empty()) {
      const auto at = line.find("bytes_received:");
      if (at != std::string::npos) out.back() = std::stoll(line.substr(at + 15));
    }
  }
  return out;
}

// A probe's loaded pull must run over a TCP connection of its own, as a pipeline's gradients come over
// the peer's own connection: without a pull client, both directions share the stream's connection.
TEST_F(PeerTest, AProbesLoadedPullRunsOverAConnectionOfItsOwn) {
  StartServer();
  auto client = Client("a");
  ProbeOptions o;
  o.bulk_bytes = 4 << 20;
  o.both_ways = true;
  auto shared = ProbeLink(*client, o);
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_EQ(BytesReceivedOnConnectionsTo(port_).size(), 1u);

  auto own = *PeerClient::Create(dir_->string(), "a", "b", "127.0.0.1:" + std::to_string(port_), true);
  auto m = ProbeLink(*client, o, own.get());
  ASSERT_TRUE(m.ok()) << m.status();
  const auto received = BytesReceivedOnConnectionsTo(port_);
  ASSERT_EQ(received.size(), 2u);
  // The pull's 4 MiB came over the new connection: it received more than a warm-up echo's bytes.
  EXPECT_GT(std::min(received[0], received[1]), o.bulk_bytes);
  // Both directions were timed (no rate is asserted: a loaded CI machine reads loopback TLS far slower).
  EXPECT_GT(m->forward_loaded_bytes_per_second, 0);
  EXPECT_GT(m->reverse_loaded_bytes_per_second, 0);
}

// A site measures its own transport's CPU cost over its own service: b's certificate may probe b (and
// only probe), and the fit gives a positive cost per frame or per byte, within sane bounds.
TEST_F(PeerTest, ASiteMeasuresItsTransportCostOverItsOwnService) {
  StartServer();
  auto self = *PeerClient::Create(dir_->string(), "b", "b", "127.0.0.1:" + std::to_string(port_));
  auto cost = MeasureTransportCost(*self, 128 << 10, 16, std::chrono::seconds(30));
  ASSERT_TRUE(cost.ok()) << cost.status();
  EXPECT_GE(cost->seconds_per_frame, 0);
  EXPECT_GE(cost->seconds_per_byte, 0);
  EXPECT_GT(cost->seconds_per_frame + cost->seconds_per_byte * (128 << 10), 0);
  // Less than 10 ms of CPU for a 128 KiB frame (measured here: about 0.3 ms): it is the transport, not a stall.
  EXPECT_LT(cost->seconds_per_frame + cost->seconds_per_byte * (128 << 10), 0.01);
  auto stream = self->OpenStream(std::chrono::seconds(5));  // b's own certificate may not send it tensors
  ASSERT_TRUE(stream.ok());
  absl::Status s = (*stream)->Send({"job", 0, 0, 0, v1::FORWARD, 0}, Frame(1000));
  if (s.ok()) s = (*stream)->Finish().status();
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(s.message()), HasSubstr("'b' may only probe its link to 'b'"));
}

// A Peer service that holds every stream unread until released: the sender's HTTP/2 window fills and
// its writes block, as on a link slower than the sender.
class StalledPeer final : public v1::Peer::Service {
 public:
  grpc::Status Stream(grpc::ServerContext*, grpc::ServerReader<v1::TensorChunk>* reader, v1::StreamAck* ack) override {
    released_.wait();
    v1::TensorChunk c;
    int64_t frames = 0;
    while (reader->Read(&c))
      if (c.offset() + static_cast<int64_t>(c.data().size()) == c.frame_bytes()) ++frames;
    ack->set_frames_received(frames);
    return grpc::Status::OK;
  }
  void Release() {
    std::call_once(once_, [this] { release_.set_value(); });
  }
  ~StalledPeer() { Release(); }

 private:
  std::once_flag once_;
  std::promise<void> release_;
  std::shared_future<void> released_ = release_.get_future().share();
};

TEST_F(PeerTest, QueuedSenderDeliversInOrderAndAcknowledges) {
  StartServer();
  auto stream = Client("a")->OpenStream(std::chrono::seconds(30));
  ASSERT_TRUE(stream.ok()) << stream.status();
  QueuedSender sender(std::move(*stream), 64 << 20);
  std::vector<std::vector<uint8_t>> sent;
  double blocked = 0;
  for (int mb = 0; mb < 6; ++mb) {
    sent.push_back(Frame(50000 + mb * 1000));
    ASSERT_TRUE(sender.Send({"job", 1, mb, 0, v1::FORWARD, 0}, sent.back(), &blocked).ok());
  }
  auto acked = sender.Finish();
  ASSERT_TRUE(acked.ok()) << acked.status();
  EXPECT_EQ(*acked, 6);
  EXPECT_EQ(sender.queued_bytes(), 0);
  for (int mb = 0; mb < 6; ++mb) {
    auto f = inbox_.Wait("a", {"job", 1, mb, 0, v1::FORWARD, 0}, Clock::now() + std::chrono::seconds(5));
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(*f, sent[mb]);
  }
}

TEST_F(PeerTest, QueuedSenderDoesNotBlockItsCallerOnAStalledLink) {
  StalledPeer stalled;  // released at the latest when the test ends (before the server below is destroyed)
  int port = 0;
  auto server = StartMtlsServer(dir_->string(), "b", "127.0.0.1:0", {&stalled}, &port);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = *PeerClient::Create(dir_->string(), "a", "b", "127.0.0.1:" + std::to_string(port));
  auto stream = client->OpenStream(std::chrono::seconds(60));
  ASSERT_TRUE(stream.ok()) << stream.status();
  // Frames larger than what the link takes while the receiver reads nothing (a receive window that does
  // not grow while nothing is read, and the sockets' buffers): the link takes part of the first and none
  // of the others, and the queue holds three of them.
  const auto big = Frame((24 << 20) / 4, "identity");
  const int64_t frame_bytes = static_cast<int64_t>(big.size());
  QueuedSender sender(std::move(*stream), 3 * frame_bytes);
  double blocked = 0;
  for (int mb = 0; mb < 3; ++mb) {
    absl::Status sent = sender.Send({"job", 1, mb, 0, v1::FORWARD, 0}, big, &blocked);
    if (!sent.ok()) stalled.Release();
    ASSERT_TRUE(sent.ok()) << sent;
  }
  // None of them has left the queue whole: the caller went on regardless.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(sender.queued_bytes(), 3 * frame_bytes);
  // A queue at its bound passes the back-pressure on: this send returns only once the link moves.
  std::atomic<bool> released{false};
  std::thread release([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    released = true;
    stalled.Release();
  });
  absl::Status sent = sender.Send({"job", 1, 3, 0, v1::FORWARD, 0}, big, &blocked);
  EXPECT_TRUE(released.load());
  release.join();
  ASSERT_TRUE(sent.ok()) << sent;
  auto acked = sender.Finish();
  ASSERT_TRUE(acked.ok()) << acked.status();
  EXPECT_EQ(*acked, 4);
  (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

TEST_F(PeerTest, QueuedSenderErrorIsStickyAndNamesThePeer) {
  StartServer();
  auto stream = Client("a")->OpenStream(std::chrono::seconds(10));
  QueuedSender sender(std::move(*stream), 4 << 20);
  ASSERT_TRUE(sender.Send({"job", 0, 0, 0, v1::FORWARD, 0}, Frame(1000)).ok());
  ASSERT_TRUE(sender.Flush().ok());
  server_->Shutdown(std::chrono::system_clock::now());
  server_.reset();
  absl::Status s;
  auto big = Frame(1 << 20, "identity");
  for (int i = 0; i < 50 && s.ok(); ++i) s = sender.Send({"job", 0, i + 1, 0, v1::FORWARD, 0}, big);
  if (s.ok()) s = sender.Flush();
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("peer 'b'"));
  EXPECT_FALSE(sender.Send({"job", 0, 99, 0, v1::FORWARD, 0}, Frame(10)).ok());
  EXPECT_FALSE(sender.Finish().ok());
}

}  // namespace
}  // namespace meridian::rpc

namespace meridian::rpc {
namespace {

// A late frame of an abandoned attempt (or any other job) is dropped, not delivered; narrowing the
// admitted peers refuses new streams from the others.
TEST_F(PeerTest, OnlyTheCurrentJobsFramesFromTheCurrentPeersAreDelivered) {
  StartServer();
  service_->SetJob(std::string("attempt-2"));
  auto client = Client("a");
  auto stream = client->OpenStream(std::chrono::seconds(30));
  ASSERT_TRUE(stream.ok()) << stream.status();
  ASSERT_TRUE((*stream)->Send({"attempt-1", 5, 0, 0, v1::FORWARD, 0}, Frame(1000)).ok());
  ASSERT_TRUE((*stream)->Send({"attempt-2", 0, 0, 0, v1::FORWARD, 0}, Frame(1000)).ok());
  auto acked = (*stream)->Finish();
  ASSERT_TRUE(acked.ok()) << acked.status();
  EXPECT_TRUE(inbox_.Wait("a", {"attempt-2", 0, 0, 0, v1::FORWARD, 0}, Clock::now() + std::chrono::seconds(5)).ok());
  EXPECT_EQ(inbox_.pending(), 0u);
  EXPECT_EQ(service_->dropped_frames(), 1);
  EXPECT_EQ(inbox_.PeerBytes("a"), 0);

  service_->SetAllowedPeers({"c"});
  auto refused = Client("a")->OpenStream(std::chrono::seconds(30));
  ASSERT_TRUE(refused.ok());
  EXPECT_FALSE((*refused)->Send({"attempt-2", 1, 0, 0, v1::FORWARD, 0}, Frame(1000)).ok() && (*refused)->Finish().ok());
}

// A frame larger than its key's tensors justify is refused before it is buffered, per direction.
TEST_F(PeerTest, AFrameLargerThanItsDirectionExpectsIsRefusedNamingPeerAndKey) {
  StartServer();
  FrameBounds bounds;
  bounds.activations = compression::MaxEncodedBytes(1000);
  bounds.control = compression::MaxEncodedBytes(16);
  service_->SetFrameBounds(bounds);
  {
    auto stream = Client("a")->OpenStream(std::chrono::seconds(30));
    ASSERT_TRUE(stream.ok());
    ASSERT_TRUE((*stream)->Send({"j", 0, 0, 0, v1::FORWARD, 0}, Frame(1000, "identity")).ok());
    // Replica buckets have no bound set here: only the limits' bound applies.
    ASSERT_TRUE((*stream)->Send({"j", 0, 0, 0, v1::REPLICA_GRADIENT, 0}, Frame(100000, "identity")).ok());
    EXPECT_TRUE((*stream)->Finish().ok());
  }
  EXPECT_TRUE(inbox_.Wait("a", {"j", 0, 0, 0, v1::FORWARD, 0}, Clock::now() + std::chrono::seconds(5)).ok());
  for (v1::Direction d : {v1::FORWARD, v1::BACKWARD, v1::CONTROL}) {
    auto stream = Client("a")->OpenStream(std::chrono::seconds(30));
    ASSERT_TRUE(stream.ok());
    const TensorKey key{"j", 1, 0, 0, d, 0};
    absl::Status sent = (*stream)->Send(key, Frame(100000, "identity"));
    absl::Status done = sent.ok() ? (*stream)->Finish().status() : sent;
    EXPECT_FALSE(done.ok()) << d;
    auto waited = inbox_.Wait("a", key, Clock::now() + std::chrono::seconds(5));
    ASSERT_FALSE(waited.ok());
    EXPECT_THAT(std::string(waited.status().message()), HasSubstr("peer 'a' sent " + key.ToString()));
    EXPECT_THAT(std::string(waited.status().message()), HasSubstr("at most"));
    inbox_.ClearPeer("a");
  }
}

}  // namespace
}  // namespace meridian::rpc
