// Mutual-TLS credentials for every Meridian channel and server, built from the cluster's certificate
// directory (written by `meridian certs init`): DIR/ca.pem, DIR/NAME.pem, DIR/NAME.key.
// This is the only place that turns certificates into gRPC credentials: there is no plaintext path.
// Thread-safe.
#ifndef MERIDIAN_RPC_CREDENTIALS_H_
#define MERIDIAN_RPC_CREDENTIALS_H_

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/server_context.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace meridian::rpc {

// Server credentials presenting NAME's certificate and requiring (and verifying against the CA) a client
// certificate. Errors: NotFound / InvalidArgument naming the file.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const std::string& certs_dir,
                                                                               const std::string& name);

// Channel credentials presenting NAME's certificate and trusting only the cluster CA.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const std::string& certs_dir,
                                                                                 const std::string& name);

// Channel arguments for reaching `peer_name`: its certificate carries DNS:<peer_name> in its
// subjectAltName, so the TLS hostname check uses the site name whatever address is dialled.
grpc::ChannelArguments PeerChannelArguments(const std::string& peer_name);

// Threads a server may run calls on (each running call holds one); 0: gRPC's default, unbounded. With
// gRPC 1.51's sync server, calls beyond the bound wait for a thread instead of being refused, so a bound
// alone would let one site starve the others: the services first bound what each client may hold open
// (CoordinatorService::kStreamsPerSite, PeerLimits::max_streams_per_peer), and ServerThreadsFor sizes the
// bound above their sum.
inline constexpr int kServerThreads = 0;
// Threads for `clients` clients of `streams_per_client` long-lived calls each, plus room for short unary
// calls (which hold a thread only while they run): the server's thread cap.
inline int ServerThreadsFor(int clients, int streams_per_client) {
  constexpr int kUnaryHeadroom = 32;
  return clients * streams_per_client + kUnaryHeadroom;
}

// What gRPC may hold of a server's received data before its calls read it (the server's resource
// quota): gRPC sizes each stream's receive window to the link's bandwidth-delay product (its BDP probe)
// and resets streams (ENHANCE_YOUR_CALM) rather than hold more, so a hostile site flooding a stream
// costs the receiver at most this beyond its frames. Legitimate streams must never come near it: at
// 64 MiB a link probe on a loaded machine was reset. (Session 29 turned the BDP probe off for a fixed
// window instead; gRPC 1.51 ignores the window it asked for and kept its 64 KiB default, which cost a
// round trip per frame on a WAN link: 16-78 Mbit/s of a 100 Mbit/s, 40 ms link, by frame size, against
// 93-95 Mbit/s with the probe.)
inline constexpr int64_t kServerTransportMemoryBytes = int64_t{256} << 20;

// Message-size limits, the transport's memory bound and keepalive policy matching PeerChannelArguments, no
// SO_REUSEPORT (a port in use fails to bind), and at most `max_threads` threads for calls (0: unbounded);
// call on every ServerBuilder.
void ConfigureServer(grpc::ServerBuilder* builder, int max_threads = kServerThreads);

// Builds and starts a gRPC server on `address` with NAME's mutual-TLS credentials, the policy of
// ConfigureServer and `services`. Errors name the certificate file or the address (Unavailable when the
// address is in use, also by another process). `port` receives the bound port (useful with port 0).
absl::StatusOr<std::unique_ptr<grpc::Server>> StartMtlsServer(const std::string& certs_dir, const std::string& name,
                                                              const std::string& address,
                                                              const std::vector<grpc::Service*>& services,
                                                              int* port = nullptr, int max_threads = kServerThreads);

// The CN of the verified client certificate of the calling peer, or "" if there is none.
std::string PeerCommonName(const grpc::ServerContext& context);

}  // namespace meridian::rpc

#endif  // MERIDIAN_RPC_CREDENTIALS_H_
