// The executor under a coordinator (joined mode): after registering, an Agent serves the site's peer
// stream, heartbeats, and carries out the coordinator's commands -- profile (measure the device, the
// model per op and the links), assign (run a stage of an attempt: executor/run_stage.h), stop -- until
// told to stop or the coordinator is lost (no heartbeat answered for the cluster's heartbeat timeout: the
// process then exits within that time).
//
// Threads: Run's thread reads the command stream and runs the handlers (OnProfile, OnAssign), one at a
// time; the heartbeat thread reads the site's state and step (atomics) and hands each answer's boundary
// and step lease to step_control_, which the stage's thread waits on between steps (it asks for a beat
// through BeatNow); the metrics reporter and the checkpoint uploader have a thread each (agent.cc);
// gRPC's threads serve the peer stream into the inbox.
#ifndef MERIDIAN_EXECUTOR_AGENT_H_
#define MERIDIAN_EXECUTOR_AGENT_H_

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include <torch/torch.h>

#include "executor/options.h"
#include "executor/step_control.h"
#include "executor/trainer.h"
#include "proto/meridian.pb.h"
#include "rpc/coordinator_client.h"
#include "rpc/peer.h"

namespace meridian::executor {

// Set (to the signal's number) by SIGTERM once InstallLeaveHandler ran: the site asks, in its
// heartbeats, to leave at the next step boundary; the coordinator re-plans without it and stops it.
extern std::atomic<int> g_leave_requested;
void InstallLeaveHandler();

class SiteGroup;
class WorkerPool;

class Agent {
 public:
  // `coordinator` (the client this site registered with) must outlive the agent.
  Agent(ExecutorOptions options, v1::RegisterResponse registration, rpc::CoordinatorClient* coordinator);

  // Returns the process exit code: 0 after a stop command, 1 when a stage failed, 2 when the peer
  // service cannot start with these settings. Call once.
  int Run();

 private:
  // Command handlers: on Run's thread only. Each reports its outcome to the coordinator (ProfileReport,
  // StageDone), errors included; nothing escapes them.
  void OnProfile(const v1::ProfileRequest& request);
  void OnAssign(const v1::StageAssignment& assignment);
  // A CPU site: the CPU its transport takes per frame and per byte (rpc::MeasureTransportCost over its own
  // peer service, at the job's activation frame, at most 4 MiB) over the share of a core it gets
  // (MeasureCpuShare): seconds of the site's compute, for SiteProfile::transport_seconds_per_frame /
  // _per_byte. Errors name what failed.
  absl::StatusOr<rpc::TransportCost> MeasureTransport(const JobSetup& setup);
  // A CPU site of one device, after measuring the model with keep_busy_seconds > 0: keeps computing the
  // model's passes on a thread of its own (KeepComputing) until StopComputing. Run's thread only.
  void StartComputing(const JobSetup& setup, double seconds);
  void StopComputing();  // stops and joins that thread (at once when none runs; the thread logs its own error)
  // The heartbeat thread's loop, until `done_`: a beat every interval, and one at once on BeatNow.
  void Heartbeats();
  void SetState(v1::SiteState state);  // and beats at once, so the coordinator's status follows
  void BeatNow();                      // the heartbeat thread beats at once (a stage waiting for its lease)
  // Workers 1..K-1 of this site for one assignment (`command`: its file) over the store file `store`.
  // A site of several devices: workers 1..K-1 started for one task -- "stage" (`command`: a serialised
  // v1::StageAssignment) or "profile" (a v1::ProfileRequest) -- in `dir` (its command and store files),
  // and their c10d group with this process, worker 0.
  struct SiteWorkers {
    std::unique_ptr<SiteGroup> group;
    std::unique_ptr<WorkerPool> pool;  // destroyed first: the workers are killed before their group closes
  };
  absl::StatusOr<SiteWorkers> StartSiteWorkers(const std::string& dir, const std::string& task,
                                               const std::string& command);

  const ExecutorOptions o_;
  const v1::RegisterResponse reg_;
  bool nan_fault_fired_ = false;  // the injected fault (o_.fault_nan_gradient_step) fires in one attempt only
  rpc::CoordinatorClient* coordinator_;
  const std::set<std::string> cluster_sites_;  // every other site: who may connect while no stage runs
  const torch::Device device_;
  // The site's devices (RegisterResponse.devices): more than one runs a worker per device; worker 0, this
  // process, keeps device_.
  const std::vector<std::string> devices_;
  rpc::TensorInbox inbox_;
  rpc::PeerService peer_service_;
  std::atomic<int64_t> step_{-1};
  std::atomic<v1::SiteState> state_{v1::SITE_IDLE};
  std::mutex heartbeat_mu_;
  std::condition_variable heartbeat_cv_;
  // Guarded by heartbeat_mu_: the process is ending; beat at once (BeatNow).
  bool done_ = false, beat_now_ = false;
  StepControl step_control_;  // the heartbeats' answers: step boundary, lease, DiLoCo workers left out
  std::thread computing_;     // StartComputing's, joined by StopComputing
  std::atomic<bool> stop_computing_{false};
  // A CPU site's share of a core (MeasureCpuShare), from MeasureTransport on; 0 before, and on a GPU site.
  // While the site is idle its peer service measures what receiving a probe costs it at that share
  // (PeerService::SetProbeCpuShare); while it computes or trains, not. Run's thread only.
  double cpu_share_ = 0;
  int rc_ = 0;
};

// A worker of a site of several devices (`meridian-executor --site-worker R/K`, started by its site's
// executor: executor/site_group.h): runs its rows of the stage in `command` (a v1::StageAssignment) in lock
// step with worker 0 over the c10d store file `store`. Returns the exit code: 0 when the stage ended, 1
// when it failed (the error is logged, naming the site and worker).
struct SiteWorkerOptions {
  std::string site, device, store, command;
  std::string task = "stage";  // or "profile": measure the model and the all-reduce with worker 0
  int rank = 1, workers = 2;
};
int RunSiteWorker(const SiteWorkerOptions& options);

}  // namespace meridian::executor

#endif  // MERIDIAN_EXECUTOR_AGENT_H_
