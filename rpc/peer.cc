#include "rpc/peer.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "compression/codec.h"
#include "core/cpu_time.h"
#include "core/thread_name.h"
#include "rpc/credentials.h"
#include "rpc/status.h"

namespace meridian::rpc {
namespace {

constexpr int64_t kMaxFrameBytes = int64_t{4} << 30;

TensorKey KeyOf(const v1::TensorChunk& c) {
  return {c.job_id(), c.step(), c.micro_batch(), c.stage(), c.direction(), c.tensor_index()};
}

}  // namespace

std::string TensorKey::ToString() const {
  return absl::StrCat("job ", job_id, " step ", step, " micro-batch ", micro_batch, " stage ", stage, " ",
                      v1::Direction_Name(direction), " tensor ", tensor_index);
}

// ---- TensorInbox ----

absl::Status TensorInbox::Deliver(const std::string& peer, const TensorKey& key, std::vector<uint8_t> frame,
                                  int64_t max_peer_bytes) {
  {
    std::lock_guard<std::mutex> l(mu_);
    int64_t& bytes = peer_bytes_[peer];
    auto it = frames_.find({peer, key});
    const int64_t replaced = it == frames_.end() ? 0 : static_cast<int64_t>(it->second.size());
    const int64_t after = bytes - replaced + static_cast<int64_t>(frame.size());
    if (after > max_peer_bytes)
      return absl::ResourceExhaustedError(absl::StrCat("peer '", peer, "' has ", bytes, " bytes of frames waiting; ",
                                                       key.ToString(), " would take it over ", max_peer_bytes));
    bytes = after;
    if (it != frames_.end()) {
      ++replaced_;
      last_replaced_ = absl::StrCat("peer '", peer, "', ", key.ToString());
    }
    frames_[{peer, key}] = std::move(frame);
  }
  cv_.notify_all();
  return absl::OkStatus();
}

int64_t TensorInbox::replaced() const {
  std::lock_guard<std::mutex> l(mu_);
  return replaced_;
}

std::string TensorInbox::last_replaced() const {
  std::lock_guard<std::mutex> l(mu_);
  return last_replaced_;
}

void TensorInbox::DropOtherJobs(const std::string& job_id) {
  std::lock_guard<std::mutex> l(mu_);
  for (auto it = frames_.begin(); it != frames_.end();) {
    if (it->first.second.job_id == job_id) {
      ++it;
      continue;
    }
    peer_bytes_[it->first.first] -= static_cast<int64_t>(it->second.size());
    it = frames_.erase(it);
  }
  for (auto peer = failed_.begin(); peer != failed_.end();) {
    std::map<std::string, std::string>& jobs = peer->second;
    for (auto it = jobs.begin(); it != jobs.end();) it = it->first == job_id ? std::next(it) : jobs.erase(it);
    peer = jobs.empty() ? failed_.erase(peer) : std::next(peer);
  }
}

int64_t TensorInbox::PeerBytes(const std::string& peer) const {
  std::lock_guard<std::mutex> l(mu_);
  auto it = peer_bytes_.find(peer);
  return it == peer_bytes_.end() ? 0 : it->second;
}

void TensorInbox::FailPeer(const std::string& peer, const std::string& why, const std::string& job_id) {
  {
    std::lock_guard<std::mutex> l(mu_);
    std::map<std::string, std::string>& jobs = failed_[peer];
    // Bounded per peer (without SetJob a peer names its jobs): beyond the bound, another job's entry goes.
    if (static_cast<int>(jobs.size()) >= kMaxFailuresPerPeer && !jobs.count(job_id))
      jobs.erase(jobs.upper_bound(""));  // the first job's ("" is every job's, and stays)
    jobs[job_id] = why;
  }
  cv_.notify_all();
}

void TensorInbox::ClearPeer(const std::string& peer) {
  std::lock_guard<std::mutex> l(mu_);
  failed_.erase(peer);
}

absl::StatusOr<std::vector<uint8_t>> TensorInbox::Wait(const std::string& peer, const TensorKey& key,
                                                       std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> l(mu_);
  while (true) {
    auto it = frames_.find({peer, key});
    if (it != frames_.end()) {
      std::vector<uint8_t> f = std::move(it->second);
      frames_.erase(it);
      peer_bytes_[peer] -= static_cast<int64_t>(f.size());
      return f;
    }
    if (auto p = failed_.find(peer); p != failed_.end()) {
      auto f = p->second.find(key.job_id);
      if (f == p->second.end()) f = p->second.find("");
      if (f != p->second.end())
        return absl::UnavailableError(
            absl::StrCat("peer '", peer, "' failed while waiting for ", key.ToString(), ": ", f->second));
    }
    if (cv_.wait_until(l, deadline) == std::cv_status::timeout && std::chrono::steady_clock::now() >= deadline)
      return absl::DeadlineExceededError(
          absl::StrCat("no ", key.ToString(), " from peer '", peer, "' before the deadline"));
  }
}

size_t TensorInbox::pending() const {
  std::lock_guard<std::mutex> l(mu_);
  return frames_.size();
}

size_t TensorInbox::failures() const {
  std::lock_guard<std::mutex> l(mu_);
  size_t n = 0;
  for (const auto& [peer, jobs] : failed_) n += jobs.size();
  return n;
}

// ---- PeerService ----

PeerService::PeerService(std::string self, std::set<std::string> allowed_peers, TensorInbox* inbox, PeerLimits limits)
    : self_(std::move(self)),
      allowed_(std::move(allowed_peers)),
      streams_(limits.max_streams_per_peer),
      inbox_(inbox),
      limits_(limits) {}

void PeerService::SetJob(std::optional<std::string> job_id) {
  if (job_id) inbox_->DropOtherJobs(*job_id);  // what an abandoned attempt left would count against its peer
  std::lock_guard<std::mutex> l(allowed_mu_);
  job_ = std::move(job_id);
}

void PeerService::SetFrameBounds(FrameBounds bounds) {
  std::lock_guard<std::mutex> l(allowed_mu_);
  bounds_ = bounds;
}

void PeerService::SetAllowedPeers(std::set<std::string> allowed_peers) {
  std::lock_guard<std::mutex> l(allowed_mu_);
  allowed_ = std::move(allowed_peers);
}

void PeerService::SetProbers(std::set<std::string> probers) {
  std::lock_guard<std::mutex> l(allowed_mu_);
  probers_ = std::move(probers);
}

grpc::Status PeerService::Authorise(grpc::ServerContext* ctx, std::string* peer, bool* prober) {
  *peer = PeerCommonName(*ctx);
  if (peer->empty()) return {grpc::StatusCode::UNAUTHENTICATED, "no verified client certificate"};
  bool allowed, only_probes;
  {
    std::lock_guard<std::mutex> l(allowed_mu_);
    allowed = allowed_.count(*peer) > 0;
    only_probes = !allowed && (probers_.count(*peer) > 0 || *peer == self_);
  }
  if (prober) *prober = only_probes;
  allowed = allowed || only_probes;
  if (!allowed)
    return {grpc::StatusCode::PERMISSION_DENIED, absl::StrCat("'", *peer, "' may not stream tensors to '", self_, "'")};
  authorised_calls_++;
  return grpc::Status::OK;
}

bool PeerService::IsCurrentJob(const std::string& job_id) {
  std::lock_guard<std::mutex> l(allowed_mu_);
  return !job_ || job_id == *job_;
}

grpc::Status PeerService::TooManyStreams(const std::string& peer) const {
  return {grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat("peer '", peer, "' already has ", streams_.per_client(), " streams open here")};
}

void PeerService::SetProbeCpuShare(double share) { probe_cpu_share_ = std::isfinite(share) && share > 0 ? share : 0; }

grpc::Status PeerService::Stream(grpc::ServerContext* ctx, grpc::ServerReader<v1::TensorChunk>* reader,
                                 v1::StreamAck* ack) {
  const double cpu_at_start = core::ProcessCpuSeconds();
  bool probes_only = true;
  std::string peer;
  bool prober = false;  // admitted to measure its link only: probe chunks alone
  if (grpc::Status s = Authorise(ctx, &peer, &prober); !s.ok()) return s;
  CallSlots::Slot slot(&streams_, peer);
  if (!slot.held()) return TooManyStreams(peer);
  inbox_->ClearPeer(peer);
  std::string opened_under;  // the job SetJob named when this stream opened ("": none, every job)
  {
    std::lock_guard<std::mutex> l(allowed_mu_);
    if (job_) opened_under = *job_;
  }
  struct Partial {
    std::vector<uint8_t> data;  // grows as the bytes arrive (probe payloads are counted, not kept)
    int64_t frame_bytes = 0;    // what the first chunk claimed
    int64_t received = 0;
  };
  std::map<TensorKey, Partial> partial;
  int64_t partial_bytes = 0;  // held in `partial`
  int64_t frames = 0;
  v1::TensorChunk c;
  std::string job;  // the job this stream carries (unknown until its first chunk)
  auto fail = [&](grpc::StatusCode code, const std::string& msg) {
    // A stream that carried a job's tensors fails that job's waits. One that carried none yet fails the
    // waits of the job current when it opened (of every job if none was), and only when it is the peer's
    // only stream here (its process may have died before its first chunk was read); beside another stream
    // of the peer it lost nothing, and failing every job would fail the attempt that other stream serves
    // (a CI run failed so when a stream was cancelled after a switch).
    // A job other than the current attempt's is waited for by nobody (its frames are dropped): not marked,
    // so that a peer cannot grow the inbox's failures by cutting off streams of made-up jobs.
    if (!job.empty()) {
      if (IsCurrentJob(job)) inbox_->FailPeer(peer, msg, job);
    } else if (streams_.open(peer) <= 1)
      inbox_->FailPeer(peer, msg, opened_under);
    return grpc::Status(code, msg);
  };
  while (reader->Read(&c)) {
    TensorKey key = KeyOf(c);
    if (prober && key.direction != v1::PROBE)
      return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                          absl::StrCat("'", peer, "' may only probe its link to '", self_, "', not stream tensors"));
    if (key.direction != v1::PROBE) {
      job = key.job_id;
      probes_only = false;
    }
    const bool probe = key.direction == v1::PROBE;
    int64_t max_frame = probe ? kMaxFrameBytes : limits_.max_frame_bytes;
    if (!probe) {
      std::lock_guard<std::mutex> l(allowed_mu_);
      const int64_t bound = key.direction == v1::REPLICA_GRADIENT ? bounds_.replica_gradients
                            : key.direction == v1::CONTROL        ? bounds_.control
                                                                  : bounds_.activations;
      if (bound > 0) max_frame = std::min(max_frame, bound);
    }
    if (c.frame_bytes() <= 0 || c.frame_bytes() > max_frame)
      return fail(grpc::StatusCode::INVALID_ARGUMENT,
                  absl::StrCat("peer '", peer, "' sent ", key.ToString(), " with frame size ", c.frame_bytes(),
                               " (at most ", max_frame, ")"));
    auto [it, begun] = partial.try_emplace(key);
    Partial& p = it->second;
    if (begun) {
      if (c.offset() != 0)
        return fail(grpc::StatusCode::INVALID_ARGUMENT,
                    absl::StrCat("peer '", peer, "' began ", key.ToString(), " at offset ", c.offset()));
      if (static_cast<int>(partial.size()) > limits_.max_partial_frames)
        return fail(grpc::StatusCode::RESOURCE_EXHAUSTED,
                    absl::StrCat("peer '", peer, "' began more than ", limits_.max_partial_frames,
                                 " frames without finishing them"));
      p.frame_bytes = c.frame_bytes();
    }
    if (c.frame_bytes() != p.frame_bytes || c.offset() != p.received ||
        c.offset() + static_cast<int64_t>(c.data().size()) > c.frame_bytes())
      return fail(grpc::StatusCode::INVALID_ARGUMENT,
                  absl::StrCat("peer '", peer, "' sent an out-of-order or oversized chunk of ", key.ToString()));
    const int64_t n = static_cast<int64_t>(c.data().size());
    if (!probe) {
      if (partial_bytes + n + inbox_->PeerBytes(peer) > limits_.max_peer_bytes)
        return fail(grpc::StatusCode::RESOURCE_EXHAUSTED,
                    absl::StrCat("peer '", peer, "' sent more than the ", limits_.max_peer_bytes,
                                 " bytes a peer's frames may occupy here"));
      p.data.insert(p.data.end(), c.data().begin(), c.data().end());
      partial_bytes += n;
    }
    p.received += n;
    if (p.received < p.frame_bytes) continue;
    std::vector<uint8_t> frame = std::move(p.data);
    const int64_t size = p.frame_bytes;
    partial_bytes -= static_cast<int64_t>(frame.size());
    partial.erase(it);
    ++frames;
    bytes_received_ += size;
    if (probe) continue;              // probe payload: counted, not delivered
    if (!IsCurrentJob(key.job_id)) {  // an abandoned attempt's, arriving late
      ++dropped_frames_;
      continue;
    }
    auto info = compression::InspectFrame(frame.data(), frame.size());
    if (!info.ok())
      return fail(grpc::StatusCode::DATA_LOSS, absl::StrCat("peer '", peer, "' sent a corrupt frame for ",
                                                            key.ToString(), ": ", info.status().message()));
    if (absl::Status s = inbox_->Deliver(peer, key, std::move(frame), limits_.max_peer_bytes); !s.ok())
      return fail(grpc::StatusCode::RESOURCE_EXHAUSTED, std::string(s.message()));
  }
  if (ctx->IsCancelled())
    return fail(grpc::StatusCode::CANCELLED, absl::StrCat("stream from peer '", peer, "' was cut off"));
  if (!partial.empty())
    return fail(grpc::StatusCode::DATA_LOSS, absl::StrCat("stream from peer '", peer, "' ended in the middle of ",
                                                          partial.begin()->first.ToString()));
  ack->set_frames_received(frames);
  if (const double share = probe_cpu_share_.load(); probes_only && frames > 0 && share > 0) {
    ack->set_probe_receive_seconds((core::ProcessCpuSeconds() - cpu_at_start) / share);
    ack->set_probe_cpu_share(share);
  }
  return grpc::Status::OK;
}

grpc::Status PeerService::Echo(grpc::ServerContext* ctx, const v1::Ping* req, v1::Ping* resp) {
  std::string peer;
  if (grpc::Status s = Authorise(ctx, &peer); !s.ok()) return s;  // a prober too
  *resp = *req;
  return grpc::Status::OK;
}

grpc::Status PeerService::Pull(grpc::ServerContext* ctx, const v1::PullRequest* req,
                               grpc::ServerWriter<v1::TensorChunk>* writer) {
  std::string peer;
  if (grpc::Status s = Authorise(ctx, &peer); !s.ok()) return s;  // a pull is a probe: probers may
  CallSlots::Slot slot(&streams_, peer);  // a probe holds a thread while it writes: it counts as a stream
  if (!slot.held()) return TooManyStreams(peer);
  if (req->bytes() < 0 || req->bytes() > kMaxFrameBytes)
    return {grpc::StatusCode::INVALID_ARGUMENT, "pull size out of range"};
  const int chunk = req->chunk_bytes() > 0 ? std::min(req->chunk_bytes(), kChunkBytes) : kChunkBytes;
  v1::TensorChunk c;
  c.set_direction(v1::PROBE);
  c.set_frame_bytes(req->bytes());
  std::string payload(static_cast<size_t>(chunk), '\0');
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<char>(i * 2654435761u >> 24);
  for (int64_t off = 0; off < req->bytes(); off += chunk) {
    c.set_offset(off);
    c.set_data(payload.data(), static_cast<size_t>(std::min<int64_t>(chunk, req->bytes() - off)));
    if (!writer->Write(c)) return {grpc::StatusCode::CANCELLED, absl::StrCat("peer '", peer, "' went away")};
  }
  return grpc::Status::OK;
}

// ---- PeerClient ----

absl::StatusOr<std::unique_ptr<PeerClient>> PeerClient::Create(const std::string& certs_dir, const std::string& self,
                                                               const std::string& peer, const std::string& address,
                                                               bool own_connection) {
  auto creds = MakeChannelCredentials(certs_dir, self);
  if (!creds.ok()) return creds.status();
  auto c = std::unique_ptr<PeerClient>(new PeerClient);
  c->peer_ = peer;
  c->address_ = address;
  grpc::ChannelArguments args = PeerChannelArguments(peer);
  if (own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  c->channel_ = grpc::CreateCustomChannel(address, *creds, args);
  c->stub_ = v1::Peer::NewStub(c->channel_);
  return c;
}

absl::StatusOr<std::unique_ptr<PeerClient::OutStream>> PeerClient::OpenStream(std::chrono::seconds deadline,
                                                                              std::chrono::seconds connect_timeout) {
  if (!channel_->WaitForConnected(std::chrono::system_clock::now() + connect_timeout))
    return absl::UnavailableError(absl::StrCat("peer '", peer_, "' at ", address_,
                                               " did not accept a connection within ", connect_timeout.count(),
                                               " s (not running, unreachable, or not trusting "
                                               "this cluster's CA)"));
  auto s = std::unique_ptr<OutStream>(new OutStream);
  s->peer_ = peer_;
  s->ctx_ = std::make_unique<grpc::ClientContext>();
  s->ctx_->set_deadline(std::chrono::system_clock::now() + deadline);
  s->ctx_->set_wait_for_ready(true);  // a neighbour that is still starting is waited for, up to the deadline
  s->writer_ = stub_->Stream(s->ctx_.get(), &s->ack_);
  if (!s->writer_) return absl::UnavailableError(absl::StrCat("cannot open a stream to peer '", peer_, "'"));
  return s;
}

absl::Status PeerClient::OutStream::Send(const TensorKey& key, const std::vector<uint8_t>& frame) {
  if (finished_) return absl::FailedPreconditionError(absl::StrCat("stream to peer '", peer_, "' is closed"));
  v1::TensorChunk c;
  c.set_job_id(key.job_id);
  c.set_step(key.step);
  c.set_micro_batch(key.micro_batch);
  c.set_stage(key.stage);
  c.set_direction(key.direction);
  c.set_tensor_index(key.tensor_index);
  c.set_frame_bytes(static_cast<int64_t>(frame.size()));
  for (size_t off = 0; off < frame.size() || (off == 0 && frame.empty()); off += kChunkBytes) {
    c.set_offset(static_cast<int64_t>(off));
    c.set_data(frame.data() + off, std::min<size_t>(kChunkBytes, frame.size() - off));
    if (!writer_->Write(c)) {
      finished_ = true;
      grpc::Status st = writer_->Finish();
      return FromGrpc(st.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "stream closed") : st,
                      absl::StrCat("sending ", key.ToString(), " to peer '", peer_, "' failed"));
    }
    if (frame.empty()) break;
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> PeerClient::OutStream::Finish() {
  if (finished_) return absl::FailedPreconditionError(absl::StrCat("stream to peer '", peer_, "' already closed"));
  finished_ = true;
  writer_->WritesDone();
  grpc::Status st = writer_->Finish();
  if (!st.ok()) return FromGrpc(st, absl::StrCat("stream to peer '", peer_, "'"));
  return ack_.frames_received();
}

void PeerClient::OutStream::Cancel() { ctx_->TryCancel(); }

PeerClient::OutStream::~OutStream() {
  if (!finished_ && writer_) {
    ctx_->TryCancel();
    (void)writer_->Finish();
  }
}

// ---- QueuedSender ----

QueuedSender::QueuedSender(std::unique_ptr<PeerClient::OutStream> stream, int64_t max_queued_bytes)
    : stream_(std::move(stream)), max_bytes_(std::max<int64_t>(max_queued_bytes, 1)) {
  thread_ = core::NamedThread("mrd-send", [this] { Run(); });
}

QueuedSender::~QueuedSender() {
  bool finished;
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
    finished = finished_;
  }
  cv_.notify_all();
  if (!finished) stream_->Cancel();  // unblocks a write held by flow control
  thread_.join();
}

void QueuedSender::Run() {
  std::unique_lock<std::mutex> l(mu_);
  while (true) {
    cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopped with nothing left to send
    if (stop_ && !finished_) return;
    auto [key, frame] = std::move(queue_.front());
    queue_.pop_front();
    writing_ = true;
    l.unlock();
    absl::Status s = stream_->Send(key, frame);
    l.lock();
    writing_ = false;
    queued_bytes_ -= static_cast<int64_t>(frame.size());
    if (!s.ok() && error_.ok()) {
      error_ = s;
      for (const auto& q : queue_) queued_bytes_ -= static_cast<int64_t>(q.second.size());
      queue_.clear();
    }
    cv_.notify_all();
  }
}

absl::Status QueuedSender::Send(const TensorKey& key, std::vector<uint8_t> frame, double* blocked_seconds) {
  std::unique_lock<std::mutex> l(mu_);
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t n = static_cast<int64_t>(frame.size());
  cv_.wait(l, [&] { return !error_.ok() || queued_bytes_ == 0 || queued_bytes_ + n <= max_bytes_; });
  if (blocked_seconds) *blocked_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!error_.ok()) return error_;
  if (finished_) return absl::FailedPreconditionError("the queued sender was finished");
  queue_.emplace_back(key, std::move(frame));
  queued_bytes_ += n;
  l.unlock();
  cv_.notify_all();
  return absl::OkStatus();
}

absl::Status QueuedSender::Flush() {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return !error_.ok() || (queue_.empty() && !writing_); });
  return error_;
}

absl::StatusOr<int64_t> QueuedSender::Finish() {
  if (absl::Status s = Flush(); !s.ok()) return s;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (finished_) return absl::FailedPreconditionError("the queued sender was already finished");
    finished_ = true;
  }
  return stream_->Finish();
}

absl::Status QueuedSender::error() const {
  std::lock_guard<std::mutex> l(mu_);
  return error_;
}

int64_t QueuedSender::queued_bytes() const {
  std::lock_guard<std::mutex> l(mu_);
  return queued_bytes_;
}

absl::StatusOr<double> PeerClient::EchoSeconds(int payload_bytes, std::chrono::milliseconds deadline) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + deadline);
  v1::Ping req, resp;
  req.set_payload(std::string(static_cast<size_t>(payload_bytes), 'p'));
  auto t0 = std::chrono::steady_clock::now();
  grpc::Status st = stub_->Echo(&ctx, req, &resp);
  auto t1 = std::chrono::steady_clock::now();
  if (!st.ok()) return FromGrpc(st, absl::StrCat("ping to peer '", peer_, "' at ", address_));
  return std::chrono::duration<double>(t1 - t0).count();
}

absl::StatusOr<double> PeerClient::PullSeconds(int64_t bytes, std::chrono::seconds deadline) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + deadline);
  v1::PullRequest req;
  req.set_bytes(bytes);
  auto t0 = std::chrono::steady_clock::now();
  auto reader = stub_->Pull(&ctx, req);
  v1::TensorChunk c;
  int64_t got = 0;
  while (reader->Read(&c)) got += static_cast<int64_t>(c.data().size());
  auto t1 = std::chrono::steady_clock::now();
  grpc::Status st = reader->Finish();
  if (!st.ok()) return FromGrpc(st, absl::StrCat("pull from peer '", peer_, "'"));
  if (got != bytes)
    return absl::DataLossError(absl::StrCat("pull from peer '", peer_, "' returned ", got, " of ", bytes, " bytes"));
  return std::chrono::duration<double>(t1 - t0).count();
}

namespace {

// One attempt of ProbeLink.
absl::StatusOr<LinkMeasurement> ProbeLinkOnce(PeerClient& client, const ProbeOptions& o, PeerClient* pull_client) {
  PeerClient& puller_client = pull_client ? *pull_client : client;
  LinkMeasurement m;
  std::vector<double> rtts;
  auto warm = client.EchoSeconds(16, std::chrono::duration_cast<std::chrono::milliseconds>(o.deadline));
  if (!warm.ok()) return warm.status();
  if (o.both_ways && pull_client) {  // its connection made (TCP, TLS) before any pull is timed
    warm = pull_client->EchoSeconds(16, std::chrono::duration_cast<std::chrono::milliseconds>(o.deadline));
    if (!warm.ok()) return warm.status();
  }
  for (int i = 0; i < o.pings; ++i) {
    auto r = client.EchoSeconds(16, std::chrono::duration_cast<std::chrono::milliseconds>(o.deadline));
    if (!r.ok()) return r.status();
    rtts.push_back(*r);
  }
  std::nth_element(rtts.begin(), rtts.begin() + rtts.size() / 2, rtts.end());
  m.rtt_seconds = rtts[rtts.size() / 2];
  // Each bulk measurement `repeats` times, the best kept: goodput only falls below what the link carries
  // (a loss that halves TCP's window, a peer busy for a moment), never above it.
  std::vector<uint8_t> payload(static_cast<size_t>(o.bulk_bytes));
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 2654435761u >> 24);
  TensorKey key;
  key.direction = v1::PROBE;
  auto rate = [&](double seconds) { return o.bulk_bytes / std::max(seconds - m.rtt_seconds, seconds / 2); };
  // The least finite reading over the repeats; 0 stays "not measured".
  auto least = [](double* kept, double reading) {
    if (reading > 0 && std::isfinite(reading) && (*kept == 0 || reading < *kept)) *kept = reading;
  };
  double cpu_per_byte = 0;  // what receiving the forward stream cost the peer, CPU seconds a byte
  for (int r = 0; r < std::max(1, o.repeats); ++r) {
    // Forward: a timed bulk stream. The last byte reaches the peer one one-way delay after it is sent and
    // its acknowledgement takes another, so one RTT is taken off the elapsed time.
    auto stream = client.OpenStream(o.deadline);
    if (!stream.ok()) return stream.status();
    auto t0 = std::chrono::steady_clock::now();
    if (absl::Status s = (*stream)->Send(key, payload); !s.ok()) return s;
    auto done = (*stream)->Finish();
    if (!done.ok()) return done.status();
    const double fwd = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    m.forward_bytes_per_second = std::max(m.forward_bytes_per_second, rate(fwd));
    // What receiving it cost the peer, in its seconds, and in CPU seconds at its share of a core.
    const double peer_seconds = (*stream)->probe_receive_seconds(), peer_share = (*stream)->probe_cpu_share();
    if (peer_seconds > 0 && peer_share > 0 && std::isfinite(peer_seconds * peer_share)) {
      least(&m.forward_receive_seconds_per_byte, peer_seconds / o.bulk_bytes);
      least(&cpu_per_byte, peer_seconds * peer_share / o.bulk_bytes);
    }
    // Reverse: the peer streams the same amount back; the request and the last byte cost one RTT.
    auto rev = client.PullSeconds(o.bulk_bytes, o.deadline);
    if (!rev.ok()) return rev.status();
    m.reverse_bytes_per_second = std::max(m.reverse_bytes_per_second, rate(*rev));
    if (!o.both_ways) continue;
    // Both directions loaded at once: the pull on a thread of its own, the stream on this one.
    absl::StatusOr<double> pulled = absl::UnknownError("not run");
    std::thread puller([&] { pulled = puller_client.PullSeconds(o.bulk_bytes, o.deadline); });
    auto both = client.OpenStream(o.deadline);
    absl::Status sent = both.ok() ? absl::OkStatus() : both.status();
    const auto t1 = std::chrono::steady_clock::now();
    if (sent.ok()) sent = (*both)->Send(key, payload);
    if (sent.ok()) sent = (*both)->Finish().status();
    const double loaded_fwd = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    puller.join();
    if (!sent.ok()) return sent;
    if (!pulled.ok()) return pulled.status();
    m.forward_loaded_bytes_per_second = std::max(m.forward_loaded_bytes_per_second, rate(loaded_fwd));
    m.reverse_loaded_bytes_per_second = std::max(m.reverse_loaded_bytes_per_second, rate(*pulled));
  }
  // The reverse direction's receive cost: the peer's CPU a byte at this site's share, where the two
  // directions run at about one rate (LinkMeasurement::reverse_receive_seconds_per_byte).
  const double fwd = m.forward_bytes_per_second, rev = m.reverse_bytes_per_second;
  if (o.cpu_share > 0 && cpu_per_byte > 0 && fwd > 0 && rev > 0 && std::max(fwd, rev) <= 1.5 * std::min(fwd, rev))
    m.reverse_receive_seconds_per_byte = cpu_per_byte / o.cpu_share;
  return m;
}

// A measurement cut off before its end: a stream or connection reset (INTERNAL, UNAVAILABLE), or one
// refused for resources (RESOURCE_EXHAUSTED: gRPC's memory reclaimer, or the peer's own stream bound while
// a cut-off stream of this prober was still open there). Not a refused identity, a deadline or a short pull.
bool CutOffByTheTransport(const absl::Status& s) {
  return s.code() == absl::StatusCode::kInternal || s.code() == absl::StatusCode::kUnavailable ||
         s.code() == absl::StatusCode::kResourceExhausted;
}

}  // namespace

absl::StatusOr<LinkMeasurement> ProbeLink(PeerClient& client, const ProbeOptions& o, PeerClient* pull_client) {
  std::vector<std::string> retried_after;
  for (int attempt = 1;; ++attempt) {
    auto m = ProbeLinkOnce(client, o, pull_client);
    if (m.ok()) {
      m->retried_after = std::move(retried_after);
      return m;
    }
    if (attempt >= o.attempts || !CutOffByTheTransport(m.status())) {
      if (retried_after.empty()) return m.status();
      return absl::Status(m.status().code(), absl::StrCat(m.status().message(), " (measured ", attempt,
                                                          " times; the first cut off: ", retried_after[0], ")"));
    }
    retried_after.emplace_back(m.status().message());
    // A reset connection is made again by the next call; a moment's pause lets the peer's side close.
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

using core::ProcessCpuSeconds;

absl::StatusOr<TransportCost> MeasureTransportCost(PeerClient& client, int64_t frame_bytes, int frames,
                                                   std::chrono::seconds deadline, std::chrono::milliseconds gap) {
  const int64_t small = std::max<int64_t>(1024, frame_bytes / 8), large = std::max(frame_bytes, 8 * small);
  std::vector<uint8_t> payload(static_cast<size_t>(large));
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 2654435761u >> 24);
  // CPU seconds for `frames` frames of `bytes` through one stream (both ends: this process).
  auto timed = [&](int64_t bytes) -> absl::StatusOr<double> {
    const std::vector<uint8_t> frame(payload.begin(), payload.begin() + bytes);
    auto stream = client.OpenStream(deadline);
    if (!stream.ok()) return stream.status();
    const double t0 = ProcessCpuSeconds();
    TensorKey key;
    key.direction = v1::PROBE;
    for (int i = 0; i < frames; ++i) {
      key.micro_batch = i;
      if (absl::Status s = (*stream)->Send(key, frame); !s.ok()) return s;
      std::this_thread::sleep_for(gap);  // spaced: each frame pays the wake-ups it pays between passes
    }
    auto done = (*stream)->Finish();
    if (!done.ok()) return done.status();
    return ProcessCpuSeconds() - t0;
  };
  if (auto warm = timed(small); !warm.ok()) return warm.status();
  double best_large = 0, best_small = 0;
  for (int round = 0; round < 2; ++round) {
    auto l = timed(large);
    if (!l.ok()) return l.status();
    auto s = timed(small);
    if (!s.ok()) return s.status();
    best_large = round == 0 ? *l : std::min(best_large, *l);
    best_small = round == 0 ? *s : std::min(best_small, *s);
  }
  const double per_large = best_large / frames / 2, per_small = best_small / frames / 2;  // one side
  TransportCost c;
  c.seconds_per_byte = std::max(0.0, (per_large - per_small) / static_cast<double>(large - small));
  c.seconds_per_frame = std::max(0.0, per_small - c.seconds_per_byte * static_cast<double>(small));
  return c;
}

}  // namespace meridian::rpc
