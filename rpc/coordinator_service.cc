#include "rpc/coordinator_service.h"

#include <cstdio>
#include <fstream>
#include <memory>

#include "absl/strings/str_cat.h"
#include "core/files.h"
#include "core/run_layout.h"
#include "core/version.h"
#include "rpc/credentials.h"
#include "rpc/idle_watch.h"
#include "rpc/status.h"

namespace meridian::rpc {
namespace {

constexpr size_t kMaxFileChunkBytes = size_t{4} << 20;

// The files sites may send (PutFile) and fetch (GetFile), relative to the run directory.
bool IsCheckpointFile(const std::string& path) {
  auto f = core::ParseSiteFile(path);
  return f && f->kind != core::SiteFile::Kind::kWeights;
}
bool IsRunFile(const std::string& path) { return core::ParseSiteFile(path).has_value(); }

}  // namespace

CoordinatorService::CoordinatorService(std::set<std::string> sites, CoordinatorHandler* handler)
    : sites_(std::move(sites)), handler_(handler) {}

grpc::Status CoordinatorService::Authorise(grpc::ServerContext* ctx, const std::string& claimed_site) {
  const std::string cn = PeerCommonName(*ctx);
  if (cn.empty()) return {grpc::StatusCode::UNAUTHENTICATED, "no verified client certificate"};
  if (!sites_.count(cn))
    return {grpc::StatusCode::PERMISSION_DENIED, absl::StrCat("certificate '", cn, "' is not a site of this cluster")};
  if (claimed_site != cn)
    return {grpc::StatusCode::PERMISSION_DENIED,
            absl::StrCat("the certificate of site '", cn, "' cannot act as site '", claimed_site, "'")};
  ++handled_;
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::Register(grpc::ServerContext* ctx, const v1::RegisterRequest* req,
                                          v1::RegisterResponse* resp) {
  if (req->protocol_version() != kProtocolVersion)
    return {grpc::StatusCode::FAILED_PRECONDITION,
            absl::StrCat("protocol version mismatch: executor speaks ", req->protocol_version(),
                         ", coordinator speaks ", kProtocolVersion, " (coordinator build ", kVersion,
                         "); run the same Meridian release at every site")};
  if (grpc::Status s = Authorise(ctx, req->site()); !s.ok()) return s;
  auto r = handler_->Register(*req);
  if (!r.ok()) return ToGrpc(r.status());
  *resp = *r;
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req,
                                           v1::HeartbeatResponse* resp) {
  if (grpc::Status s = Authorise(ctx, req->site()); !s.ok()) return s;
  auto r = handler_->Heartbeat(*req);
  if (!r.ok()) return ToGrpc(r.status());
  *resp = *r;
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::Commands(grpc::ServerContext* ctx, const v1::CommandStreamRequest* req,
                                          grpc::ServerWriter<v1::Command>* writer) {
  if (grpc::Status s = Authorise(ctx, req->site()); !s.ok()) return s;
  int64_t mine;
  {
    std::lock_guard<std::mutex> l(per_site_mu_);
    mine = ++command_streams_[req->site()];
  }
  auto superseded = [&] {
    std::lock_guard<std::mutex> l(per_site_mu_);
    return command_streams_[req->site()] != mine;
  };
  while (!ctx->IsCancelled()) {
    if (superseded())
      return {grpc::StatusCode::CANCELLED,
              absl::StrCat("site '", req->site(), "' opened a newer command stream; this one ends")};
    auto c = handler_->NextCommand(req->site(), std::chrono::milliseconds(200));
    if (!c.ok()) return ToGrpc(c.status());
    if (!c->has_value()) continue;
    if (!writer->Write(**c)) {
      handler_->Requeue(req->site(), std::move(**c));
      return {grpc::StatusCode::UNAVAILABLE, absl::StrCat("site '", req->site(), "' went away")};
    }
    if ((*c)->has_stop()) break;
  }
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::ReportMetrics(grpc::ServerContext* ctx, const v1::MetricsReport* req,
                                               v1::MetricsAck*) {
  if (grpc::Status s = Authorise(ctx, req->site()); !s.ok()) return s;
  return ToGrpc(handler_->Metrics(*req));
}

grpc::Status CoordinatorService::ReportProfile(grpc::ServerContext* ctx, const v1::ProfileReport* req,
                                               v1::MetricsAck*) {
  if (grpc::Status s = Authorise(ctx, req->site()); !s.ok()) return s;
  return ToGrpc(handler_->Profile(*req));
}

grpc::Status CoordinatorService::ReportDone(grpc::ServerContext* ctx, const v1::StageDone* req, v1::MetricsAck*) {
  if (grpc::Status s = Authorise(ctx, req->site()); !s.ok()) return s;
  return ToGrpc(handler_->Done(*req));
}

grpc::Status CoordinatorService::Inspect(grpc::ServerContext* ctx, const v1::InspectRequest*,
                                         v1::InspectResponse* resp) {
  const std::string cn = PeerCommonName(*ctx);
  if (cn.empty()) return {grpc::StatusCode::UNAUTHENTICATED, "no verified client certificate"};
  if (cn != "coordinator" && !sites_.count(cn))
    return {grpc::StatusCode::PERMISSION_DENIED,
            absl::StrCat("certificate '", cn, "' is neither the coordinator's nor a site's of this cluster")};
  ++handled_;
  auto r = handler_->Inspect();
  if (!r.ok()) return ToGrpc(r.status());
  *resp = *r;
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::Drain(grpc::ServerContext* ctx, const v1::DrainRequest* req, v1::DrainResponse* resp) {
  const std::string cn = PeerCommonName(*ctx);
  if (cn.empty()) return {grpc::StatusCode::UNAUTHENTICATED, "no verified client certificate"};
  if (cn != "coordinator")
    return {grpc::StatusCode::PERMISSION_DENIED,
            absl::StrCat("certificate '", cn, "' may not drain sites: only the operator's (the coordinator's) may")};
  ++handled_;
  auto r = handler_->Drain(req->site());
  if (!r.ok()) return ToGrpc(r.status());
  *resp = *r;
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::PutFile(grpc::ServerContext* ctx, grpc::ServerReader<v1::FileChunk>* reader,
                                         v1::FileAck* ack) {
  v1::FileChunk chunk;
  if (!reader->Read(&chunk))
    return {grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat("PutFile from '", PeerCommonName(*ctx), "': the stream carried no chunk")};
  if (grpc::Status s = Authorise(ctx, chunk.site()); !s.ok()) return s;
  const std::string site = chunk.site(), path = chunk.path();
  CallSlots::Slot slot(&uploads_running_, site);
  if (!slot.held())
    return {grpc::StatusCode::RESOURCE_EXHAUSTED,
            absl::StrCat("PutFile from site '", site, "': already ", kUploadsPerSite, " uploads running")};
  if (!IsRunFile(path))
    return {grpc::StatusCode::INVALID_ARGUMENT, absl::StrCat("PutFile from site '", site, "': path '", path,
                                                             "' is not accepted (only weights/stage-K.safetensors and "
                                                             "checkpoints/step-S/stage-K.safetensors or .json)")};
  const std::string job_id = chunk.job_id();
  auto grant = handler_->FileDestination(site, job_id, path);
  if (!grant.ok()) return ToGrpc(grant.status());
  const std::string dest = grant->path;
  const std::string part = absl::StrCat(dest, ".part-", site, "-", uploads_.fetch_add(1));
  auto fail = [&](grpc::StatusCode code, const std::string& why) {
    std::remove(part.c_str());
    return grpc::Status(code, absl::StrCat("PutFile ", path, " from site '", site, "': ", why));
  };
  std::ofstream out(part, std::ios::binary | std::ios::trunc);
  if (!out) return fail(grpc::StatusCode::INTERNAL, absl::StrCat("cannot write ", part));
  core::Sha256 sha;
  int64_t bytes = 0;
  std::string want;
  IdleWatch idle(std::chrono::milliseconds(upload_idle_ms_.load()),
                 [ctx] { ctx->TryCancel(); });  // a stalled upload must not hold its slot
  do {
    idle.Touch();
    if (!want.empty()) return fail(grpc::StatusCode::INVALID_ARGUMENT, "a chunk after the one with the SHA-256");
    if (chunk.data().size() > kMaxFileChunkBytes)
      return fail(grpc::StatusCode::INVALID_ARGUMENT,
                  absl::StrCat("a chunk of ", chunk.data().size(), " bytes (at most ", kMaxFileChunkBytes, ")"));
    if (chunk.data().empty() && chunk.sha256().empty() && bytes > 0)
      return fail(grpc::StatusCode::INVALID_ARGUMENT, "an empty chunk before the last");
    bytes += static_cast<int64_t>(chunk.data().size());
    if (bytes > grant->max_bytes)
      return fail(grpc::StatusCode::RESOURCE_EXHAUSTED,
                  absl::StrCat("more than the ", grant->max_bytes, " bytes such a file may have"));
    out.write(chunk.data().data(), static_cast<std::streamsize>(chunk.data().size()));
    sha.Update(chunk.data());
    if (!chunk.sha256().empty()) want = chunk.sha256();
  } while (reader->Read(&chunk));
  out.close();
  if (!out) return fail(grpc::StatusCode::INTERNAL, absl::StrCat("writing ", part, " failed"));
  if (idle.fired())
    return fail(grpc::StatusCode::CANCELLED,
                absl::StrCat("no data for ", idle.idle().count(), " ms after ", bytes, " bytes; the upload is ended"));
  if (ctx->IsCancelled()) return fail(grpc::StatusCode::CANCELLED, absl::StrCat("cut off after ", bytes, " bytes"));
  if (want.empty())
    return fail(grpc::StatusCode::DATA_LOSS, absl::StrCat("no SHA-256 after ", bytes, " bytes (cut off?)"));
  if (sha.HexDigest() != want)
    return fail(grpc::StatusCode::DATA_LOSS, absl::StrCat("SHA-256 mismatch over ", bytes, " bytes"));
  if (absl::Status s = core::SyncFile(part); !s.ok()) return fail(grpc::StatusCode::INTERNAL, std::string(s.message()));
  if (absl::Status s = handler_->FileCommit(site, job_id, path, part, dest, bytes, want); !s.ok())
    return fail(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
  ack->set_bytes(bytes);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::GetFile(grpc::ServerContext* ctx, const v1::FileRequest* req,
                                         grpc::ServerWriter<v1::FileChunk>* writer) {
  if (grpc::Status s = Authorise(ctx, req->site()); !s.ok()) return s;
  const std::string site = req->site();
  CallSlots::Slot slot(&fetches_running_, site);
  if (!slot.held())
    return {grpc::StatusCode::RESOURCE_EXHAUSTED,
            absl::StrCat("GetFile from site '", site, "': already ", kFetchesPerSite, " fetches running")};
  if (!IsCheckpointFile(req->path()))
    return {grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat("GetFile from site '", req->site(), "': path '", req->path(),
                         "' is not accepted (only checkpoints/step-S/stage-K.safetensors or .json)")};
  auto src = handler_->FileSource(req->site(), req->path());
  if (!src.ok()) return ToGrpc(src.status());
  std::ifstream in(*src, std::ios::binary);
  if (!in)
    return {grpc::StatusCode::NOT_FOUND,
            absl::StrCat("GetFile from site '", req->site(), "': cannot read ", req->path())};
  core::Sha256 sha;
  std::string buf(size_t{1} << 20, '\0');
  for (;;) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const size_t n = static_cast<size_t>(in.gcount());
    if (in.bad())
      return {grpc::StatusCode::INTERNAL,
              absl::StrCat("GetFile from site '", req->site(), "': reading ", req->path(), " failed")};
    v1::FileChunk c;
    c.set_path(req->path());
    c.set_data(buf.data(), n);
    sha.Update(std::string_view(buf.data(), n));
    const bool last = !in;
    if (last) c.set_sha256(sha.HexDigest());
    if (!writer->Write(c)) return {grpc::StatusCode::UNAVAILABLE, absl::StrCat("site '", req->site(), "' went away")};
    if (last) return grpc::Status::OK;
  }
}

}  // namespace meridian::rpc
