#include "rpc/coordinator_service.h"

#include "absl/strings/str_cat.h"
#include "core/version.h"
#include "rpc/credentials.h"

namespace meridian::rpc {
namespace {

grpc::Status ToGrpc(const absl::Status& s) {
  return {static_cast<grpc::StatusCode>(s.code()), std::string(s.message())};
}

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
  while (!ctx->IsCancelled()) {
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

}  // namespace meridian::rpc
