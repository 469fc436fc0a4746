#include "rpc/credentials.h"

#include <grpcpp/security/auth_context.h>
#include <grpcpp/server_builder.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "core/certs.h"
#include "core/files.h"

namespace meridian::rpc {
namespace {

absl::StatusOr<std::string> Read(const std::string& path) { return core::ReadFile(path); }

struct Material {
  std::string ca, cert, key;
};

absl::StatusOr<Material> Load(const std::string& dir, const std::string& name) {
  absl::Status check = core::CheckIdentityFiles(dir, name);
  if (!check.ok()) return check;
  Material m;
  auto ca = Read(dir + "/ca.pem");
  if (!ca.ok()) return ca.status();
  auto cert = Read(absl::StrCat(dir, "/", name, ".pem"));
  if (!cert.ok()) return cert.status();
  auto key = Read(absl::StrCat(dir, "/", name, ".key"));
  if (!key.ok()) return key.status();
  return Material{*ca, *cert, *key};
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const std::string& dir,
                                                                               const std::string& name) {
  auto m = Load(dir, name);
  if (!m.ok()) return m.status();
  grpc::SslServerCredentialsOptions o(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  o.pem_root_certs = m->ca;
  o.pem_key_cert_pairs.push_back({m->key, m->cert});
  return grpc::SslServerCredentials(o);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const std::string& dir,
                                                                                 const std::string& name) {
  auto m = Load(dir, name);
  if (!m.ok()) return m.status();
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = m->ca;
  o.pem_private_key = m->key;
  o.pem_cert_chain = m->cert;
  return grpc::SslCredentials(o);
}

constexpr int kKeepaliveTimeMs = 2000, kKeepaliveTimeoutMs = 20000;

grpc::ChannelArguments PeerChannelArguments(const std::string& peer_name) {
  grpc::ChannelArguments args;
  args.SetSslTargetNameOverride(peer_name);
  args.SetMaxReceiveMessageSize(8 << 20);
  args.SetMaxSendMessageSize(8 << 20);
  // Keepalive pings notice a peer that vanished without closing its connection (SIGSTOP, a cut link)
  // within about 22 s, even on a stream that is idle. gRPC also makes the timeout the socket's
  // TCP_USER_TIMEOUT (data unacknowledged that long closes the connection), so it must outlast a slow,
  // lossy link's retransmissions: 2 s broke link probes at 2 Mbit/s with 80 ms RTT. A lost site is
  // detected sooner by the coordinator's heartbeats (heartbeat.timeout).
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  return args;
}

void ConfigureServer(grpc::ServerBuilder* builder, int max_threads) {
  grpc::ResourceQuota quota("meridian-server");
  // What gRPC may hold unread: past it, gRPC resets streams rather than hold more.
  quota.Resize(kServerTransportMemoryBytes);
  if (max_threads > 0) quota.SetMaxThreads(max_threads);  // every running call holds one of them
  builder->SetResourceQuota(quota);
  builder->SetMaxReceiveMessageSize(8 << 20);
  builder->SetMaxSendMessageSize(8 << 20);
  // Accept the clients' 2 s keepalive pings (the default minimum interval would reject them).
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  // gRPC sets SO_REUSEPORT on Linux by default: a second process on the same port would bind too and the
  // kernel would split connections between them (a site started twice, two tests handed one port).
  // Binding a port in use must fail instead.
  builder->AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartMtlsServer(const std::string& certs_dir, const std::string& name,
                                                              const std::string& address,
                                                              const std::vector<grpc::Service*>& services, int* port,
                                                              int max_threads) {
  auto creds = MakeServerCredentials(certs_dir, name);
  if (!creds.ok()) return creds.status();
  grpc::ServerBuilder builder;
  ConfigureServer(&builder, max_threads);
  int bound = 0;
  builder.AddListeningPort(address, *creds, &bound);
  for (grpc::Service* s : services) builder.RegisterService(s);
  auto server = builder.BuildAndStart();
  if (!server || bound == 0) return absl::UnavailableError(absl::StrCat("cannot listen on ", address));
  if (port) *port = bound;
  return server;
}

std::string PeerCommonName(const grpc::ServerContext& context) {
  auto auth = context.auth_context();
  if (!auth || !auth->IsPeerAuthenticated()) return "";
  auto values = auth->FindPropertyValues("x509_common_name");
  if (values.empty()) return "";
  return std::string(values.front().data(), values.front().size());
}

}  // namespace meridian::rpc
