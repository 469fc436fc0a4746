// The coordinator as its callers see it: every call an executor makes (register, heartbeat, the command
// stream, reports, put and get file) and the operator's Inspect (`meridian status`, `doctor`). Callers
// depend on this interface, not on a gRPC stub, so the executor's agent can be tested against an
// in-process coordinator. Two implementations:
//  - over gRPC with mutual TLS (ConnectCoordinator): the production path;
//  - in-process (InProcessCoordinatorClient): calls a CoordinatorHandler directly, as c10d's HashStore
//    serves its tests. It skips the service's authentication (there is no certificate to check) but
//    keeps its path rules; for tests only.
// Errors keep the coordinator's status code; messages name the call and the path. Thread-safe: the
// heartbeat thread, the metrics reporter and the agent call one client concurrently.
#ifndef MERIDIAN_RPC_COORDINATOR_CLIENT_H_
#define MERIDIAN_RPC_COORDINATOR_CLIENT_H_

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "proto/meridian.pb.h"
#include "rpc/coordinator_service.h"

namespace meridian::rpc {

class CoordinatorClient {
 public:
  using Timeout = std::chrono::milliseconds;

  // The commands for one site, in order. Next blocks until a command arrives (true) or the stream ends
  // (false; Finish then says why). Cancel, from any thread, makes a blocked Next return false.
  class CommandStream {
   public:
    virtual ~CommandStream() = default;
    virtual bool Next(v1::Command* command) = 0;
    virtual void Cancel() = 0;
    virtual absl::Status Finish() = 0;
  };

  virtual ~CoordinatorClient() = default;
  // Waits up to `timeout` for the coordinator to come up (a site may start first).
  virtual absl::StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& request, Timeout timeout) = 0;
  virtual absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request, Timeout timeout) = 0;
  virtual std::unique_ptr<CommandStream> Commands(const std::string& site) = 0;
  virtual absl::Status ReportMetrics(const v1::MetricsReport& report, Timeout timeout) = 0;
  virtual absl::Status ReportProfile(const v1::ProfileReport& report, Timeout timeout) = 0;
  virtual absl::Status ReportDone(const v1::StageDone& done, Timeout timeout) = 0;
  // Sends the local file `local` to the coordinator's run directory as `path` (core/run_layout.h's site
  // files), for `site` in attempt `job_id`, with its SHA-256; the coordinator stores it whole or not at
  // all. No deadline (a slow link may take hours): DeadlineExceeded after kTransferIdleTimeout without
  // progress.
  virtual absl::Status PutFile(const std::string& site, const std::string& job_id, const std::string& local,
                               const std::string& path) = 0;
  // Fetches the run directory's checkpoint file `path` into the local file `local` (its directory is
  // created), checking the SHA-256 the coordinator sends. No deadline: DeadlineExceeded after
  // kTransferIdleTimeout without a chunk.
  virtual absl::Status GetFile(const std::string& site, const std::string& path, const std::string& local) = 0;
  virtual absl::StatusOr<v1::InspectResponse> Inspect(Timeout timeout) = 0;
  virtual absl::StatusOr<v1::DrainResponse> Drain(const std::string& site, Timeout timeout) = 0;
};

// A client of the coordinator at `address`, presenting `identity`'s certificate from `certs_dir` (a site's
// name, or "coordinator" for the operator). Fails only when the credentials do not load; an unreachable
// coordinator shows in the calls.
// How long a file transfer may go without progress (GetFile and PutFile of the gRPC client).
inline constexpr std::chrono::seconds kTransferIdleTimeout{300};

absl::StatusOr<std::unique_ptr<CoordinatorClient>> ConnectCoordinator(
    const std::string& certs_dir, const std::string& identity, const std::string& address,
    std::chrono::milliseconds transfer_idle = kTransferIdleTimeout);

// A client that calls `handler` in this process. `handler` must outlive it.
std::unique_ptr<CoordinatorClient> InProcessCoordinatorClient(CoordinatorHandler* handler);

}  // namespace meridian::rpc

#endif  // MERIDIAN_RPC_COORDINATOR_CLIENT_H_
