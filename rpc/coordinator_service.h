// The coordinator's gRPC service, kept apart from what the coordinator does (Ray's style): this class
// authenticates and authorises every call, then forwards it to a CoordinatorHandler, which can be tested
// without a network. Authorisation: the caller's certificate CN must be a site of the cluster, the site a
// request names must be that CN, and Register's protocol version must match. A rejected call never
// reaches the handler.
#ifndef MERIDIAN_RPC_COORDINATOR_SERVICE_H_
#define MERIDIAN_RPC_COORDINATOR_SERVICE_H_

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "proto/meridian.grpc.pb.h"
#include "rpc/call_slots.h"

namespace meridian::rpc {

// What the coordinator does with authorised calls. Implementations must be thread-safe: gRPC calls them
// from its own threads.
class CoordinatorHandler {
 public:
  virtual ~CoordinatorHandler() = default;
  virtual absl::StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& request) = 0;
  virtual absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request) = 0;
  // The next command for `site`, waiting up to `timeout`; nullopt when none came (the stream then polls
  // again), or an error that ends the stream.
  virtual absl::StatusOr<std::optional<v1::Command>> NextCommand(const std::string& site,
                                                                 std::chrono::milliseconds timeout) = 0;
  // A command NextCommand gave out could not be written to the site's stream (it went away): it goes
  // back to the front of the site's queue, for the site's next stream.
  virtual void Requeue(const std::string& site, v1::Command command) = 0;
  virtual absl::Status Metrics(const v1::MetricsReport& report) = 0;
  virtual absl::Status Profile(const v1::ProfileReport& report) = 0;
  virtual absl::Status Done(const v1::StageDone& done) = 0;
  virtual absl::StatusOr<v1::InspectResponse> Inspect() = 0;
  // The operator asks that `site` leave at the next step boundary (`meridian drain`). NotFound for a site
  // outside the cluster, FailedPrecondition when it has not joined.
  virtual absl::StatusOr<v1::DrainResponse> Drain(const std::string& site) = 0;
  // Where `site`'s file `path` (relative to the run directory, its form already checked by the service) of
  // attempt `job_id` is to be stored -- an absolute path whose directory exists -- and how large it may
  // be. PermissionDenied when `site` does not write that file in the attempt running, FailedPrecondition
  // for an attempt that is over or a coordinator that keeps no files, InvalidArgument for a step the job
  // never reaches.
  struct FileGrant {
    std::string path;
    int64_t max_bytes = 0;
  };
  virtual absl::StatusOr<FileGrant> FileDestination(const std::string& site, const std::string& job_id,
                                                    const std::string& path) = 0;
  // The file arrived whole in `part` (`bytes` whose SHA-256 is `sha256`, checked, synced): renames it to
  // `dest` (what FileDestination gave) if attempt `job_id` still runs -- atomically with respect to the
  // start of another attempt -- else returns the error (the service then deletes `part`).
  virtual absl::Status FileCommit(const std::string& site, const std::string& job_id, const std::string& path,
                                  const std::string& part, const std::string& dest, int64_t bytes,
                                  const std::string& sha256) = 0;
  // The stored file `path` (relative to the run directory, already checked by the service) that `site`
  // asks for: an absolute path. NotFound when there is no such file.
  virtual absl::StatusOr<std::string> FileSource(const std::string& site, const std::string& path) = 0;
};

class CoordinatorService final : public v1::Coordinator::Service {
 public:
  static constexpr int kUploadsPerSite = 2;
  static constexpr int kFetchesPerSite = 2;
  // The long-lived calls one site may hold open at once: its command stream, its uploads and its fetches
  // (the server's thread cap is sized from it: ServerThreadsFor).
  static constexpr int kStreamsPerSite = 1 + kUploadsPerSite + kFetchesPerSite;
  CoordinatorService(std::set<std::string> sites, CoordinatorHandler* handler);
  grpc::Status Register(grpc::ServerContext* ctx, const v1::RegisterRequest* req, v1::RegisterResponse* resp) override;
  grpc::Status Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse* resp) override;
  // One stream per site: a newer one supersedes the one before (which ends with Cancelled), so a site that
  // reconnects gets its commands and one that opens streams without end holds one.
  grpc::Status Commands(grpc::ServerContext* ctx, const v1::CommandStreamRequest* req,
                        grpc::ServerWriter<v1::Command>* writer) override;
  grpc::Status ReportMetrics(grpc::ServerContext* ctx, const v1::MetricsReport* req, v1::MetricsAck* resp) override;
  grpc::Status ReportProfile(grpc::ServerContext* ctx, const v1::ProfileReport* req, v1::MetricsAck* resp) override;
  grpc::Status ReportDone(grpc::ServerContext* ctx, const v1::StageDone* req, v1::MetricsAck* resp) override;
  // Read-only; allowed to the "coordinator" identity and to every site.
  grpc::Status Inspect(grpc::ServerContext* ctx, const v1::InspectRequest* req, v1::InspectResponse* resp) override;
  // The coordinator's own identity only.
  grpc::Status Drain(grpc::ServerContext* ctx, const v1::DrainRequest* req, v1::DrainResponse* resp) override;
  // At most kUploadsPerSite at once per site (ResourceExhausted beyond); ended after the upload idle
  // timeout without a chunk.
  // Writes the stream to a temporary file beside FileDestination's path, within its size bound, checks the
  // SHA-256, syncs it, then has FileCommit rename it into place; a refused or broken upload leaves no
  // file. Paths other than
  // "weights/stage-K.safetensors" and "checkpoints/step-S/stage-K.{safetensors,json}" are refused
  // (InvalidArgument) before the handler is asked.
  grpc::Status PutFile(grpc::ServerContext* ctx, grpc::ServerReader<v1::FileChunk>* reader, v1::FileAck* ack) override;
  // Streams FileSource's file in 1 MiB chunks, the SHA-256 with the last. Only checkpoint paths; at most
  // kFetchesPerSite at once per site (ResourceExhausted beyond).
  grpc::Status GetFile(grpc::ServerContext* ctx, const v1::FileRequest* req,
                       grpc::ServerWriter<v1::FileChunk>* writer) override;

  // Calls that reached the handler (tests check that rejected calls never do).
  int64_t handled_calls() const { return handled_.load(); }

  // An upload that sends nothing for this long is ended (Cancelled) and leaves no file; it then no longer
  // holds one of its site's kUploadsPerSite. Default kUploadIdleTimeout; applies to uploads begun after.
  static constexpr std::chrono::seconds kUploadIdleTimeout{60};
  void set_upload_idle_timeout(std::chrono::milliseconds idle) { upload_idle_ms_ = idle.count(); }

 private:
  grpc::Status Authorise(grpc::ServerContext* ctx, const std::string& claimed_site);
  std::set<std::string> sites_;
  CoordinatorHandler* handler_;
  std::atomic<int64_t> handled_{0};
  std::atomic<int64_t> uploads_{0};  // names each upload's temporary file
  std::atomic<int64_t> upload_idle_ms_{std::chrono::milliseconds(kUploadIdleTimeout).count()};
  std::mutex per_site_mu_;
  std::map<std::string, int64_t> command_streams_;  // by site: the newest stream's number; guarded
  CallSlots uploads_running_{kUploadsPerSite};      // PutFile calls by site
  CallSlots fetches_running_{kFetchesPerSite};      // GetFile calls by site
};

}  // namespace meridian::rpc

#endif  // MERIDIAN_RPC_COORDINATOR_SERVICE_H_
