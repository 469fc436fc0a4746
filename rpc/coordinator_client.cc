#include "rpc/coordinator_client.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "core/files.h"
#include "core/run_layout.h"
#include "proto/meridian.grpc.pb.h"
#include "rpc/credentials.h"
#include "rpc/idle_watch.h"
#include "rpc/status.h"

namespace meridian::rpc {
namespace {

namespace fs = std::filesystem;

std::chrono::system_clock::time_point Deadline(CoordinatorClient::Timeout timeout) {
  return std::chrono::system_clock::now() + timeout;
}

// Reads `local` in 1 MiB pieces, calling `chunk(data, last, sha256-if-last)` for each; false from
// `chunk` stops. Errors name the file.
template <typename Chunk>
absl::Status ReadChunks(const std::string& local, Chunk chunk) {
  std::ifstream in(local, std::ios::binary);
  if (!in) return absl::InternalError(absl::StrCat("cannot read ", local));
  core::Sha256 sha;
  std::string buf(size_t{1} << 20, '\0');
  for (;;) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const size_t n = static_cast<size_t>(in.gcount());
    if (in.bad()) return absl::InternalError(absl::StrCat("reading ", local, " failed"));  // never a partial digest
    const std::string_view data(buf.data(), n);
    sha.Update(data);
    const bool last = !in;
    if (!chunk(data, last, last ? sha.HexDigest() : std::string()) || last) return absl::OkStatus();
  }
}

class GrpcCommandStream final : public CoordinatorClient::CommandStream {
 public:
  GrpcCommandStream(v1::Coordinator::Stub* stub, const std::string& site) {
    v1::CommandStreamRequest req;
    req.set_site(site);
    reader_ = stub->Commands(&ctx_, req);
  }
  bool Next(v1::Command* command) override { return reader_->Read(command); }
  void Cancel() override { ctx_.TryCancel(); }
  absl::Status Finish() override { return FromGrpc(reader_->Finish(), "the command stream"); }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<v1::Command>> reader_;
};

class GrpcCoordinatorClient final : public CoordinatorClient {
 public:
  GrpcCoordinatorClient(std::shared_ptr<grpc::Channel> channel, std::string address,
                        std::chrono::milliseconds transfer_idle)
      : stub_(v1::Coordinator::NewStub(std::move(channel))),
        address_(std::move(address)),
        transfer_idle_(transfer_idle) {}

  absl::StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& req, Timeout timeout) override {
    return Unary<v1::RegisterResponse>(&v1::Coordinator::Stub::Register, req, timeout, /*wait_for_ready=*/true);
  }
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& req, Timeout timeout) override {
    return Unary<v1::HeartbeatResponse>(&v1::Coordinator::Stub::Heartbeat, req, timeout);
  }
  std::unique_ptr<CommandStream> Commands(const std::string& site) override {
    return std::make_unique<GrpcCommandStream>(stub_.get(), site);
  }
  absl::Status ReportMetrics(const v1::MetricsReport& r, Timeout timeout) override {
    return Unary<v1::MetricsAck>(&v1::Coordinator::Stub::ReportMetrics, r, timeout).status();
  }
  absl::Status ReportProfile(const v1::ProfileReport& r, Timeout timeout) override {
    return Unary<v1::MetricsAck>(&v1::Coordinator::Stub::ReportProfile, r, timeout).status();
  }
  absl::Status ReportDone(const v1::StageDone& d, Timeout timeout) override {
    return Unary<v1::MetricsAck>(&v1::Coordinator::Stub::ReportDone, d, timeout).status();
  }
  absl::StatusOr<v1::DrainResponse> Drain(const std::string& site, Timeout timeout) override {
    v1::DrainRequest req;
    req.set_site(site);
    return Unary<v1::DrainResponse>(&v1::Coordinator::Stub::Drain, req, timeout);
  }
  absl::StatusOr<v1::InspectResponse> Inspect(Timeout timeout) override {
    return Unary<v1::InspectResponse>(&v1::Coordinator::Stub::Inspect, v1::InspectRequest(), timeout);
  }

  absl::Status PutFile(const std::string& site, const std::string& job_id, const std::string& local,
                       const std::string& path) override {
    std::error_code ec;
    const auto size = fs::file_size(local, ec);
    if (ec) return absl::InternalError(absl::StrCat("cannot read ", local, ": ", ec.message()));
    // No deadline: at 1 Mbit/s a shard takes hours. The bound is time without progress.
    grpc::ClientContext ctx;
    IdleWatch idle(transfer_idle_, [&ctx] { ctx.TryCancel(); });
    v1::FileAck ack;
    auto writer = stub_->PutFile(&ctx, &ack);
    bool first = true;
    absl::Status read = ReadChunks(local, [&](std::string_view data, bool last, const std::string& sha) {
      v1::FileChunk c;
      if (first) c.set_site(site), c.set_job_id(job_id), c.set_path(path);
      first = false;
      c.set_data(data.data(), data.size());
      if (last) c.set_sha256(sha);
      const bool ok = writer->Write(c);
      idle.Touch();
      return ok;
    });
    if (!read.ok()) {  // never a checksum of part of the file
      ctx.TryCancel();
      (void)writer->Finish();
      return absl::Status(read.code(), absl::StrCat("sending ", path, ": ", read.message()));
    }
    writer->WritesDone();
    grpc::Status s = writer->Finish();
    if (idle.fired())
      return absl::DeadlineExceededError(absl::StrCat("sending ", path, " to the coordinator at ", address_,
                                                      ": no progress for ", idle.idle().count() / 1000.0, " s"));
    if (!s.ok())
      return FromGrpc(s, absl::StrCat("sending ", path, " (", size, " bytes) to the coordinator at ", address_));
    if (ack.bytes() != static_cast<int64_t>(size))
      return absl::DataLossError(
          absl::StrCat("the coordinator stored ", ack.bytes(), " bytes of ", path, ", not ", size));
    return absl::OkStatus();
  }

  absl::Status GetFile(const std::string& site, const std::string& path, const std::string& local) override {
    std::error_code ec;
    fs::create_directories(fs::path(local).parent_path(), ec);
    if (ec)
      return absl::InternalError(
          absl::StrCat("fetching ", path, ": cannot create the directory of ", local, ": ", ec.message()));
    std::ofstream out(local, std::ios::binary | std::ios::trunc);
    if (!out) return absl::InternalError(absl::StrCat("fetching ", path, ": cannot write ", local));
    core::Sha256 sha;
    // No deadline: at 1 Mbit/s a shard takes hours. The bound is time without progress.
    grpc::ClientContext ctx;
    IdleWatch idle(transfer_idle_, [&ctx] { ctx.TryCancel(); });
    v1::FileRequest req;
    req.set_site(site);
    req.set_path(path);
    auto reader = stub_->GetFile(&ctx, req);
    v1::FileChunk c;
    std::string want;
    int64_t bytes = 0;
    while (reader->Read(&c)) {
      idle.Touch();
      out.write(c.data().data(), static_cast<std::streamsize>(c.data().size()));
      sha.Update(c.data());
      bytes += static_cast<int64_t>(c.data().size());
      if (!c.sha256().empty()) want = c.sha256();
    }
    grpc::Status s = reader->Finish();
    out.close();
    if (idle.fired())
      return absl::DeadlineExceededError(absl::StrCat("fetching ", path, " from the coordinator at ", address_,
                                                      ": no progress for ", idle.idle().count() / 1000.0, " s"));
    if (!s.ok()) return FromGrpc(s, absl::StrCat("fetching ", path, " from the coordinator at ", address_));
    if (!out) return absl::InternalError(absl::StrCat("writing ", local, " failed"));
    if (want.empty() || sha.HexDigest() != want)
      return absl::DataLossError(
          absl::StrCat("fetching ", path, " from the coordinator: SHA-256 mismatch over ", bytes, " bytes"));
    return absl::OkStatus();
  }

 private:
  // One call; its error keeps the coordinator's code and message (callers say what they were doing).
  template <typename Resp, typename Req, typename Method>
  absl::StatusOr<Resp> Unary(Method method, const Req& req, Timeout timeout, bool wait_for_ready = false) {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(timeout));
    ctx.set_wait_for_ready(wait_for_ready);
    Resp resp;
    grpc::Status s = (stub_.get()->*method)(&ctx, req, &resp);
    if (!s.ok()) return FromGrpc(s);
    return resp;
  }

  std::unique_ptr<v1::Coordinator::Stub> stub_;
  const std::string address_;
  const std::chrono::milliseconds transfer_idle_;
};

// ---- In process ----

class InProcessCommandStream final : public CoordinatorClient::CommandStream {
 public:
  InProcessCommandStream(CoordinatorHandler* handler, std::string site) : handler_(handler), site_(std::move(site)) {}
  bool Next(v1::Command* command) override {
    while (!cancelled_) {
      auto next = handler_->NextCommand(site_, std::chrono::milliseconds(50));
      if (!next.ok()) {
        status_ = next.status();
        return false;
      }
      if (*next) {
        *command = std::move(**next);
        return true;
      }
    }
    status_ = absl::CancelledError("the command stream was cancelled");
    return false;
  }
  void Cancel() override { cancelled_ = true; }
  absl::Status Finish() override { return status_; }

 private:
  CoordinatorHandler* handler_;
  const std::string site_;
  std::atomic<bool> cancelled_{false};
  absl::Status status_;
};

class InProcessClient final : public CoordinatorClient {
 public:
  explicit InProcessClient(CoordinatorHandler* handler) : handler_(handler) {}
  absl::StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& r, Timeout) override {
    return handler_->Register(r);
  }
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& r, Timeout) override {
    return handler_->Heartbeat(r);
  }
  std::unique_ptr<CommandStream> Commands(const std::string& site) override {
    return std::make_unique<InProcessCommandStream>(handler_, site);
  }
  absl::Status ReportMetrics(const v1::MetricsReport& r, Timeout) override { return handler_->Metrics(r); }
  absl::Status ReportProfile(const v1::ProfileReport& r, Timeout) override { return handler_->Profile(r); }
  absl::Status ReportDone(const v1::StageDone& d, Timeout) override { return handler_->Done(d); }
  absl::StatusOr<v1::InspectResponse> Inspect(Timeout) override { return handler_->Inspect(); }
  absl::StatusOr<v1::DrainResponse> Drain(const std::string& site, Timeout) override { return handler_->Drain(site); }

  absl::Status PutFile(const std::string& site, const std::string& job_id, const std::string& local,
                       const std::string& path) override {
    if (!core::ParseSiteFile(path))
      return absl::InvalidArgumentError(
          absl::StrCat("PutFile from site '", site, "': path '", path, "' is not accepted"));
    auto grant = handler_->FileDestination(site, job_id, path);
    if (!grant.ok()) return grant.status();
    const std::string part = absl::StrCat(grant->path, ".part-", site, "-", uploads_.fetch_add(1));
    int64_t bytes = 0;
    std::string sha256;
    absl::Status s;
    {
      std::ofstream out(part, std::ios::binary | std::ios::trunc);
      if (!out) return absl::InternalError(absl::StrCat("cannot write ", part));
      s = ReadChunks(local, [&](std::string_view data, bool last, const std::string& digest) {
        if (last) sha256 = digest;
        bytes += static_cast<int64_t>(data.size());
        if (bytes > grant->max_bytes) return false;
        out.write(data.data(), static_cast<std::streamsize>(data.size()));
        return static_cast<bool>(out);
      });
      out.close();
      if (s.ok() && bytes > grant->max_bytes)
        s = absl::ResourceExhaustedError(
            absl::StrCat("PutFile ", path, ": more than the ", grant->max_bytes, " bytes"));
      if (s.ok() && !out) s = absl::InternalError(absl::StrCat("writing ", part, " failed"));
    }
    if (s.ok()) s = core::SyncFile(part);
    if (s.ok()) s = handler_->FileCommit(site, job_id, path, part, grant->path, bytes, sha256);
    if (!s.ok()) std::remove(part.c_str());
    return s;
  }

  absl::Status GetFile(const std::string& site, const std::string& path, const std::string& local) override {
    auto f = core::ParseSiteFile(path);
    if (!f || f->kind == core::SiteFile::Kind::kWeights)
      return absl::InvalidArgumentError(
          absl::StrCat("GetFile from site '", site, "': path '", path, "' is not accepted"));
    auto src = handler_->FileSource(site, path);
    if (!src.ok()) return src.status();
    std::error_code ec;
    fs::create_directories(fs::path(local).parent_path(), ec);
    fs::copy_file(*src, local, fs::copy_options::overwrite_existing, ec);
    if (ec) return absl::InternalError(absl::StrCat("fetching ", path, " into ", local, ": ", ec.message()));
    return absl::OkStatus();
  }

 private:
  CoordinatorHandler* handler_;
  std::atomic<int64_t> uploads_{0};
};

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorClient>> ConnectCoordinator(const std::string& certs_dir,
                                                                      const std::string& identity,
                                                                      const std::string& address,
                                                                      std::chrono::milliseconds transfer_idle) {
  auto creds = MakeChannelCredentials(certs_dir, identity);
  if (!creds.ok()) return creds.status();
  auto channel = grpc::CreateCustomChannel(address, *creds, PeerChannelArguments("coordinator"));
  return std::unique_ptr<CoordinatorClient>(new GrpcCoordinatorClient(std::move(channel), address, transfer_idle));
}

std::unique_ptr<CoordinatorClient> InProcessCoordinatorClient(CoordinatorHandler* handler) {
  return std::make_unique<InProcessClient>(handler);
}

}  // namespace meridian::rpc
