// Tensor streams between executors over mutual TLS (proto/meridian.proto, service Peer).
//
// A sender opens one long-lived stream per neighbour (PeerClient::OpenStream) and writes each tensor
// as a compression frame cut into chunks of at most kChunkBytes; gRPC's flow control gives
// back-pressure (a Write blocks while the receiver is behind). A training stage writes through a
// QueuedSender, so that the back-pressure holds the sender's thread and not the stage's compute thread. The receiver
// (PeerService) reassembles the chunks, checks the frame's integrity (compression::InspectFrame validates header and
// checksum) and hands it to a TensorInbox, where the training loop waits for it by key.
#ifndef MERIDIAN_RPC_PEER_H_
#define MERIDIAN_RPC_PEER_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/meridian.grpc.pb.h"
#include "rpc/call_slots.h"

namespace meridian::rpc {

inline constexpr int kChunkBytes = 4 << 20;

// Identifies one tensor in flight: every chunk carries all of it.
struct TensorKey {
  std::string job_id;
  int64_t step = 0;
  int32_t micro_batch = 0;
  int32_t stage = 0;  // the sender's stage
  v1::Direction direction = v1::FORWARD;
  int32_t tensor_index = 0;
  auto Tie() const { return std::tie(job_id, step, micro_batch, stage, direction, tensor_index); }
  bool operator<(const TensorKey& o) const { return Tie() < o.Tie(); }
  bool operator==(const TensorKey& o) const { return Tie() == o.Tie(); }
  std::string ToString() const;
};

// Frames delivered by peers, waited for by key. Thread-safe.
class TensorInbox {
 public:
  // Stores a complete frame from `peer`, unless the frames of `peer` waiting to be taken would then hold
  // more than `max_peer_bytes` (ResourceExhausted naming the peer; nothing stored). A frame for a key
  // already waiting replaces it (counted: replaced()).
  absl::Status Deliver(const std::string& peer, const TensorKey& key, std::vector<uint8_t> frame,
                       int64_t max_peer_bytes = INT64_MAX);
  // Bytes of `peer`'s frames waiting to be taken.
  int64_t PeerBytes(const std::string& peer) const;
  // Removes every waiting frame of a job other than `job_id` (an abandoned attempt's, never to be taken),
  // and every peer failure marked for another job or for every job: those were marked before job
  // `job_id` began, and concern an attempt it replaced (a CI run failed when a stream of the attempt
  // before, cut off between the attempts, failed the new attempt's first waits on that peer).
  void DropOtherJobs(const std::string& job_id);
  // Marks `peer` failed: current and later waits for its tensors return Unavailable naming it and `why`.
  // With `job_id`, only waits for that job's tensors fail (a stream of an abandoned attempt that breaks
  // late must not fail the attempt that replaced it). Each job's failure is kept apart: marking one job
  // neither replaces nor clears another's, up to kMaxFailuresPerPeer jobs per peer (beyond that another
  // job's mark goes; the every-job mark stays).
  void FailPeer(const std::string& peer, const std::string& why, const std::string& job_id = "");
  static constexpr int kMaxFailuresPerPeer = 16;
  // Clears a failure (the peer reconnected).
  void ClearPeer(const std::string& peer);
  // Waits until the frame for `key` from `peer` arrives and removes it. Errors: DeadlineExceeded naming the
  // peer and the key; Unavailable when the peer failed.
  absl::StatusOr<std::vector<uint8_t>> Wait(const std::string& peer, const TensorKey& key,
                                            std::chrono::steady_clock::time_point deadline);
  size_t pending() const;
  size_t failures() const;  // failure marks held, over every peer and job
  // Frames that replaced a frame of the same peer and key not yet taken, so far. Senders never send a key
  // twice, so each is a duplicate or a protocol error whose frame was lost: callers report a growth of
  // this. `last_replaced` names the last such frame ("peer 'x', job ... step ..."), empty before one.
  int64_t replaced() const;
  std::string last_replaced() const;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<std::string, TensorKey>, std::vector<uint8_t>> frames_;
  std::map<std::string, int64_t> peer_bytes_;  // the sizes of frames_, by peer
  int64_t replaced_ = 0;
  std::string last_replaced_;
  // peer -> (job id, or "" for every job) -> why: one entry per job, so that a late failure of an
  // abandoned attempt's stream does not replace the current attempt's.
  std::map<std::string, std::map<std::string, std::string>> failed_;
};

// What one peer may make a receiver hold (assume a peer may be hostile: docs/security.md).
struct PeerLimits {
  int64_t max_frame_bytes = int64_t{2} << 30;  // a frame may claim at most this
  int max_partial_frames = 16;                 // frames begun and not finished, per stream
  int max_streams_per_peer = 4;                // streams (tensor streams and probes) open at once from one peer
  // Bytes a peer's frames may occupy: the ones waiting in the inbox plus its streams' partial frames.
  int64_t max_peer_bytes = int64_t{2} << 30;
};

// The largest frame a stage expects per direction (0: only PeerLimits::max_frame_bytes bounds it), from
// its tensors' shapes (compression::MaxEncodedBytes): activations and their gradients, replica gradient
// buckets, control messages.
struct FrameBounds {
  int64_t activations = 0;        // FORWARD and BACKWARD
  int64_t replica_gradients = 0;  // REPLICA_GRADIENT
  int64_t control = 0;            // CONTROL
};

// The Peer service. Only callers whose certificate CN is in `allowed_peers` are served; others get
// PermissionDenied before any chunk is read. A stream's frames are buffered as their bytes arrive (never
// at the size a chunk claims) within `limits`; a peer that exceeds them has its stream ended with
// ResourceExhausted or InvalidArgument, naming it. Frames of a job other than SetJob's are dropped, and
// so are failures of such a job's stream (nobody waits for them).
// A stream that ends badly (cut off, or ended by one of those errors) fails the inbox's waits for its
// peer's tensors of the job it carried (TensorInbox::FailPeer). One that carried no tensor yet (none, or
// probes only) fails waits only when it was the peer's only stream here: beside another stream of the
// peer it lost nothing, and a sender that cancels such a stream after a switch must not fail the attempt
// the peer's other stream serves. It then fails the waits of the job SetJob named when it opened (its
// process may have died before its first chunk was read), or of every job if none was named; a job
// named later by SetJob is not failed by it. Thread-safe.
class PeerService final : public v1::Peer::Service {
 public:
  PeerService(std::string self, std::set<std::string> allowed_peers, TensorInbox* inbox, PeerLimits limits = {});
  // From now on only frames of job (attempt) `job_id` are delivered; others are dropped as they complete,
  // counted in dropped_frames(). An empty id drops every frame (probes still work); nullopt, the default,
  // delivers every job's frames (static mode). A job id also drops the inbox's waiting frames and peer
  // failures of the jobs before it (TensorInbox::DropOtherJobs).
  void SetJob(std::optional<std::string> job_id);
  // From now on a frame claiming more than `bounds` allows for its direction ends its stream with
  // InvalidArgument naming the peer and the key (probes keep their own bound). Default: none beyond the
  // limits. Set by a stage once it knows its shapes.
  void SetFrameBounds(FrameBounds bounds);
  int64_t dropped_frames() const { return dropped_frames_.load(); }
  // Replaces who is served from now on (a joined executor narrows it to its stage's peers while it runs
  // an assignment); streams already open go on.
  void SetAllowedPeers(std::set<std::string> allowed_peers);
  // Sites that may measure their link to this one besides the allowed peers -- a site joining a running
  // job, named by the coordinator: Echo, Pull and Stream calls carrying PROBE chunks only (any other
  // chunk ends the stream with PermissionDenied). Replaces the set; empty: none. This process's own
  // certificate (`self`) may always probe (MeasureTransportCost).
  void SetProbers(std::set<std::string> probers);
  // Whether, and at what share of a core, this site measures what receiving a probe stream costs it: with
  // `share` > 0 a stream of probe chunks only is acknowledged with the process's CPU seconds while it
  // lasted over `share` (StreamAck::probe_receive_seconds), the receiving end of rpc::ProbeLink's bulk
  // stream. 0, the default, measures nothing: a GPU site (its transport runs beside the device), and a
  // CPU site while it trains or computes, whose other threads' CPU would be counted in.
  void SetProbeCpuShare(double share);
  grpc::Status Stream(grpc::ServerContext* ctx, grpc::ServerReader<v1::TensorChunk>* reader,
                      v1::StreamAck* ack) override;
  grpc::Status Echo(grpc::ServerContext* ctx, const v1::Ping* req, v1::Ping* resp) override;
  grpc::Status Pull(grpc::ServerContext* ctx, const v1::PullRequest* req,
                    grpc::ServerWriter<v1::TensorChunk>* writer) override;
  // Bytes of complete frames received so far (all peers).
  int64_t bytes_received() const { return bytes_received_.load(); }
  // Handler invocations that passed authorisation (tests check that rejected calls never get here).
  int64_t authorised_calls() const { return authorised_calls_.load(); }

 private:
  // OK for an allowed peer or a prober (then *prober, when given, is set: it may only probe);
  // PermissionDenied naming it otherwise.
  grpc::Status Authorise(grpc::ServerContext* ctx, std::string* peer, bool* prober = nullptr);
  // ResourceExhausted naming `peer`, which holds all its limits.max_streams_per_peer streams already.
  grpc::Status TooManyStreams(const std::string& peer) const;
  // Whether frames of `job_id` are delivered: no job named (static mode), or the one SetJob named.
  bool IsCurrentJob(const std::string& job_id);
  std::string self_;
  std::mutex allowed_mu_;
  std::set<std::string> allowed_;   // guarded by allowed_mu_
  std::set<std::string> probers_;   // guarded by allowed_mu_
  std::optional<std::string> job_;  // guarded by allowed_mu_
  CallSlots streams_;               // Stream and Pull calls by peer (a probe holds a thread too)
  FrameBounds bounds_;              // guarded by allowed_mu_
  TensorInbox* inbox_;
  const PeerLimits limits_;
  std::atomic<int64_t> dropped_frames_{0};
  std::atomic<int64_t> bytes_received_{0};
  std::atomic<int64_t> authorised_calls_{0};
  std::atomic<double> probe_cpu_share_{0};
};

// A client of one peer's service. Thread-compatible: one thread per open stream.
class PeerClient {
 public:
  // `certs_dir`/`self`: this process's identity; `peer`/`address`: whom to reach. gRPC lets the channels of
  // a process to one address share a TCP connection; with `own_connection` this client's is its own.
  static absl::StatusOr<std::unique_ptr<PeerClient>> Create(const std::string& certs_dir, const std::string& self,
                                                            const std::string& peer, const std::string& address,
                                                            bool own_connection = false);

  // One long-lived outgoing stream of frames. Send blocks under back-pressure; every error names the peer.
  class OutStream {
   public:
    absl::Status Send(const TensorKey& key, const std::vector<uint8_t>& frame);
    // Closes the stream and waits for the receiver's acknowledgement (frames received).
    absl::StatusOr<int64_t> Finish();
    // After Finish, for a stream of probe chunks: the receiving site's seconds for it and the share of a
    // core they are at (StreamAck::probe_receive_seconds, probe_cpu_share; 0 when that site does not
    // measure it).
    double probe_receive_seconds() const { return ack_.probe_receive_seconds(); }
    double probe_cpu_share() const { return ack_.probe_cpu_share(); }
    // Cancels the stream: a Send blocked in another thread returns with an error. Thread-safe.
    void Cancel();
    ~OutStream();

   private:
    friend class PeerClient;
    std::string peer_;
    std::unique_ptr<grpc::ClientContext> ctx_;
    v1::StreamAck ack_;
    std::unique_ptr<grpc::ClientWriter<v1::TensorChunk>> writer_;
    bool finished_ = false;
  };
  // Waits up to `connect_timeout` for the peer to accept a connection (it may still be starting), then
  // opens the stream; `deadline` bounds the whole stream. Errors: Unavailable naming the peer and address.
  absl::StatusOr<std::unique_ptr<OutStream>> OpenStream(
      std::chrono::seconds deadline, std::chrono::seconds connect_timeout = std::chrono::seconds(30));

  // Round trip of a small message. Errors name the peer.
  absl::StatusOr<double> EchoSeconds(int payload_bytes, std::chrono::milliseconds deadline);
  // Receives `bytes` of probe data from the peer; returns seconds from request to last byte.
  absl::StatusOr<double> PullSeconds(int64_t bytes, std::chrono::seconds deadline);

  const std::string& peer() const { return peer_; }

 private:
  std::string peer_, address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Peer::Stub> stub_;
};

// Sends the frames of one OutStream from a thread of its own, so that the caller -- a stage's compute
// thread -- never waits for the network, HTTP/2 flow control or TLS unless `max_queued_bytes` are already
// queued (then back-pressure reaches it, and the time it waited is reported). Frames go out in the order
// given. The first failed send is sticky: every later Send, Flush and Finish returns it, naming the peer.
// Thread-safe; meant for one producer.
class QueuedSender {
 public:
  QueuedSender(std::unique_ptr<PeerClient::OutStream> stream, int64_t max_queued_bytes);
  // Cancels the stream if Finish was not called (frames still queued are dropped) and joins the thread.
  ~QueuedSender();
  QueuedSender(const QueuedSender&) = delete;
  QueuedSender& operator=(const QueuedSender&) = delete;

  // Queues `frame` for `key`. Blocks only while the queue already holds max_queued_bytes (a larger frame
  // waits for an empty queue); adds the seconds it blocked to *blocked_seconds when given.
  absl::Status Send(const TensorKey& key, std::vector<uint8_t> frame, double* blocked_seconds = nullptr);
  // Waits until every queued frame has been handed to gRPC.
  absl::Status Flush();
  // Flushes, then closes the stream and waits for the receiver's acknowledgement (frames received).
  absl::StatusOr<int64_t> Finish();
  // Bytes queued and not yet handed to gRPC.
  int64_t queued_bytes() const;
  // The sticky error of a failed write, if any (OK otherwise); does not wait.
  absl::Status error() const;

 private:
  void Run();
  std::unique_ptr<PeerClient::OutStream> stream_;
  const int64_t max_bytes_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<TensorKey, std::vector<uint8_t>>> queue_;
  int64_t queued_bytes_ = 0;  // including the frame being written
  bool writing_ = false, stop_ = false, finished_ = false;
  absl::Status error_;
  std::thread thread_;
};

// Link measurements between this process and one peer, in profile.json's link format.
struct LinkMeasurement {
  double rtt_seconds = 0;               // median of ping-pongs
  double forward_bytes_per_second = 0;  // this -> peer (timed bulk stream)
  double reverse_bytes_per_second = 0;  // peer -> this (timed bulk pull)
  // Both at once, as a pipeline link carries activations one way and gradients the other: each
  // direction's acknowledgements then queue behind the other's data, and goodput drops (measured: 1.63
  // and 1.84 Mbit/s on a 2 Mbit/s tbf link that carries 1.93 one way). 0 unless ProbeOptions::both_ways.
  // As in a pipeline, each direction's data should have a TCP connection of its own (ProbeLink's
  // `pull_client`): on one connection the pull's data also holds back the HTTP/2 window updates of the
  // stream going out, and one direction read half the link's rate in some probes (1.0 of 2 Mbit/s).
  double forward_loaded_bytes_per_second = 0, reverse_loaded_bytes_per_second = 0;
  // What receiving costs the receiving site per byte at the link's rate, in that site's own seconds, the
  // least of the unloaded bulk streams (other work only adds to it). Over a slow link a frame trickles in
  // and the receiving threads wake for a few segments at a time, so this grows as the link slows
  // (docs/cost-model.md). Measured where a pipeline receives, in the receiver's peer service:
  // - forward: the peer's, as its service acknowledged the bulk stream (PeerService::SetProbeCpuShare);
  // - reverse: the same CPU a byte at this site's share (ProbeOptions::cpu_share), where the two
  //   directions' rates are within 1.5x of each other: the same software receiving at about the same
  //   rate. (This process's CPU during the pull is not it: the pull is read by gRPC's client, and on the
  //   emulated WAN it bypasses the latency relay that hands a site its incoming streams in gathered
  //   chunks; at 100 Mbit/s it read 14-16 ns a byte where the service read 4-5.)
  // 0: not measured. Both rest on the peer's word: finite and positive, or 0, but not otherwise checked.
  double forward_receive_seconds_per_byte = 0, reverse_receive_seconds_per_byte = 0;
  // The transport errors that cut off earlier attempts of this measurement (ProbeOptions::attempts), in
  // order; empty when the first attempt completed. The caller logs them.
  std::vector<std::string> retried_after;
};
struct ProbeOptions {
  int pings = 15;
  int64_t bulk_bytes = 8 << 20;
  std::chrono::seconds deadline{60};
  bool both_ways = false;  // also time a bulk stream and a bulk pull at once
  int repeats = 1;         // each bulk measurement this many times, the best kept
  // This process's share of a core, for LinkMeasurement::reverse_receive_seconds_per_byte; 0: not
  // priced (a GPU site).
  double cpu_share = 0;
  // A measurement cut off by the transport -- its stream or connection reset (INTERNAL, UNAVAILABLE,
  // RESOURCE_EXHAUSTED) -- is begun again from its pings, at most this many attempts in all: a link probe
  // fails its site's whole profile, and one CI run saw a probe stream reset by gRPC 1.51's HTTP/2 flow
  // control (RST_STREAM PROTOCOL_ERROR). Any other error (a refused identity, a deadline, a short pull)
  // fails at once.
  int attempts = 2;
};
// Measures the link to `client`'s peer. With both_ways, the loaded pull goes over `pull_client` when given
// (a client of the same peer made with own_connection), else over `client`'s connection. An attempt cut
// off by the transport is begun again (ProbeOptions::attempts, LinkMeasurement::retried_after); the last
// error otherwise. Not thread-safe for one `client` (its calls are sequential).
absl::StatusOr<LinkMeasurement> ProbeLink(PeerClient& client, const ProbeOptions& options,
                                          PeerClient* pull_client = nullptr);

// The CPU time this process's transport takes per frame sent or received -- TLS, gRPC, the kernel's TCP;
// no codec -- measured over `client`, a PeerClient of this process to its own PeerService (which admits
// its own certificate to probe): `frames` frames of `frame_bytes` and as many of an eighth of that go
// through one stream each, `gap` apart, the process's CPU time (both ends) is read around each, and
// seconds_per_frame + seconds_per_byte * bytes is fitted to the two and halved for one side, the best of
// two rounds (the receiving end counts probe payloads without keeping them: one copy fewer than a real
// frame). The gap matters, and the default is a pipeline's: a stream carries one frame per micro-batch,
// tens of milliseconds apart on a CPU site (the README demo's about 27 ms). Measured here between two
// processes, a 35 KB frame cost the sender about 0.14 ms of CPU and the receiver 0.3 ms at 2 ms apart,
// and 0.36 ms and 0.45 ms at 10, 25 or 50 ms apart -- what the demo's sites' threads used per frame
// (0.31 ms sending, 0.44 ms receiving); back to back, frames share gRPC's and the kernel's wake-ups and
// read cheaper still. Errors: the stream's, naming the peer.
struct TransportCost {
  double seconds_per_frame = 0, seconds_per_byte = 0;  // CPU seconds, one side, both >= 0
};
absl::StatusOr<TransportCost> MeasureTransportCost(PeerClient& self_client, int64_t frame_bytes, int frames,
                                                   std::chrono::seconds deadline,
                                                   std::chrono::milliseconds gap = std::chrono::milliseconds(20));

}  // namespace meridian::rpc

#endif  // MERIDIAN_RPC_PEER_H_
