// The coordinator's live state, as the gRPC service needs it: which sites joined, their heartbeats,
// their latest reports (for `meridian status` and /metrics), the commands waiting for each and who may
// send files. It implements rpc::CoordinatorHandler (called on gRPC's threads): handlers update this
// state and only enqueue an event for the run loop (EventQueue), which owns the decisions
// (coordinator/run_machine.h). Thread-safe: one mutex guards the state; the per-site log files have their
// own, never taken while holding the first.
#ifndef MERIDIAN_COORDINATOR_COORDINATOR_H_
#define MERIDIAN_COORDINATOR_COORDINATOR_H_

#include <chrono>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "coordinator/run_machine.h"
#include "core/cluster_spec.h"
#include "core/run_layout.h"
#include "rpc/coordinator_service.h"

namespace meridian::coordinator {

// "idle", "profiling", "training", "done", "failed" (or "unknown"): a site's state in status and logs.
const char* SiteStateName(v1::SiteState state);

// Events from the gRPC handlers to the run loop. Thread-safe.
class EventQueue {
 public:
  using Body = decltype(Event::what);
  void Push(Body event);
  // The oldest event, waiting for one until `deadline`; nullopt when none came.
  std::optional<Body> PopUntil(Clock::time_point deadline);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Body> events_;
};

class Coordinator : public rpc::CoordinatorHandler {
 public:
  struct Site {
    bool registered = false;
    std::string listen, device;
    v1::SiteState state = v1::SITE_IDLE;
    Clock::time_point last_heartbeat;
    int64_t step = -1;
    std::deque<v1::Command> commands;
    std::optional<v1::ProfileReport> profile;
    std::optional<v1::StageDone> done;
    std::optional<v1::MetricsReport> metrics;  // the latest of the current attempt
    bool leaving = false;                      // it asked to leave (SiteLeaving was enqueued once)
  };
  struct Progress {
    int64_t step = -1;
    double loss = 0, step_seconds = 0;
    int64_t tokens = 0;
  };

  // `events` (may be null: nothing is reported) receives a site's registration, profile, metrics of the
  // running attempt and every StageDone.
  Coordinator(core::ClusterSpec spec, std::string run_id, EventQueue* events = nullptr);

  // rpc::CoordinatorHandler
  absl::StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& r) override;
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& r) override;
  absl::StatusOr<std::optional<v1::Command>> NextCommand(const std::string& site,
                                                         std::chrono::milliseconds timeout) override;
  void Requeue(const std::string& site, v1::Command command) override;
  absl::Status Metrics(const v1::MetricsReport& r) override;
  absl::Status Profile(const v1::ProfileReport& r) override;
  absl::Status Done(const v1::StageDone& d) override;
  absl::StatusOr<v1::InspectResponse> Inspect() override;
  absl::StatusOr<v1::DrainResponse> Drain(const std::string& site) override;
  absl::StatusOr<FileGrant> FileDestination(const std::string& site, const std::string& job_id,
                                            const std::string& path) override;
  absl::Status FileCommit(const std::string& site, const std::string& job_id, const std::string& path,
                          const std::string& part, const std::string& dest, int64_t bytes,
                          const std::string& sha256) override;
  absl::StatusOr<std::string> FileSource(const std::string& site, const std::string& path) override;

  // For the run loop.
  // The run directory: files the sites send (PutFile) are stored under it. Until set, none is accepted.
  void SetFileDir(const std::string& dir);
  // Who may send files in the attempt begun with BeginJob: `writers` maps a site to the stage whose
  // weights and checkpoint shards it writes (replica 0 of it); checkpoint steps up to `max_step`; files up
  // to `max_bytes`. A checkpoint step must be after `resume_step` and either the attempt's step boundary
  // (SetBoundary: a switch's, where every stage saves) or, with `checkpoint_interval` > 0, a multiple of
  // it at most two intervals ahead of the progress; and a stage's JSON must describe the
  // shard its writer sent (stage, the plan's number of stages, SHA-256); once every writer sent both
  // files of a step, the coordinator writes the step's manifest (core/checkpoint_dir.h), which alone
  // makes the step count. `round_writers` maps each replica of a DiLoCo stage to its (stage, replica):
  // it alone sends that replica's round state (stage-K.replica-R.*, its JSON describing the shard it
  // sent), listed in the manifest as it arrives. A site fetches only the files `readable` lists for it
  // (the run machine's choice: every stage JSON of `resume_step`, the shards holding its own stage's
  // tensors, and its own round state when its stage resumes it). With `quota_bytes` > 0 the files under
  // the run directory's checkpoints/ and weights/ may total at most that: an upload is granted what is
  // left of it, and of the filesystem's free space. BeginJob clears it.
  void SetFileWriters(std::map<std::string, int> writers, int64_t max_step, int64_t max_bytes,
                      int checkpoint_interval = 0, int64_t resume_step = 0,
                      std::map<std::string, std::set<std::string>> readable = {}, int64_t quota_bytes = 0,
                      std::map<std::string, std::pair<int, int>> round_writers = {});
  // What Inspect reports besides the live state: the run's profile, graph and current plan (JSON).
  void SetRunInfo(std::string profile_json, std::string graph_json, std::string plan_json);

  // ---- The run's history, for RunJson (the dashboard's /api/run and `meridian status --json`). ----
  // The run's size: its optimizer steps and the tokens each trains on (global batch x sequence length).
  void SetRunFacts(int64_t steps, int64_t tokens_per_step);
  // One completed step: a line of RUN/metrics.jsonl (coordinator/run_machine.cc, ReportStep), parsed.
  // The newest kStepsKept are kept, each numbered in the order recorded ("seq", from 1: a resumed attempt
  // records step numbers again, so the numbers alone do not say what is new).
  void RecordStep(nlohmann::json step);
  // One event (RecordEvent in coordinator/run_machine.h), stamped now (UTC) with the progress step; the
  // newest kEventsKept are kept, and each is appended to the event log once SetEventLog named one. The
  // coordinator adds its own: a "checkpoint" when its store completes a step's manifest.
  void RecordEvent(const std::string& kind, const std::string& site, const std::string& text);
  // From now on every event is also appended as a JSON line to `path` (RUN/events.jsonl).
  void SetEventLog(const std::string& path);
  static constexpr size_t kStepsKept = 2000, kEventsKept = 1000;
  // The run as one JSON document (docs/coordinator.md, "The run as JSON"): cluster, run and job ids,
  // progress, every site's state and latest metrics, the plan, the measured links, the predicted and
  // compute-bound tokens/s, the newest `max_steps` of the steps recorded after seq `after` (0: all kept)
  // and every kept event. Compact JSON; the state is copied under the lock and serialised outside it.
  std::string RunJson(int64_t after = 0, size_t max_steps = kStepsKept) const;
  // What Inspect (`meridian status --json`) carries of the steps: the newest ones (a gRPC message is at
  // most 8 MiB); /api/run serves all kept.
  static constexpr size_t kInspectSteps = 200;
  // Per-site logs: from now on LogSite appends its lines with a UTC timestamp to DIR/<site>.log. The run
  // loop logs the machine's decisions about a site (join, measurements, assignments, progress, lost and
  // back, completion); the handlers log the files a site sends and fetches.
  void SetLogDir(const std::string& dir);
  void LogSite(const std::string& site, const std::string& text);
  // Starts an attempt at the job, whose plan runs stage `stages[site]` at each of its sites: forgets every
  // site's StageDone, the progress step (the tokens count on) and who may send files. From now on Done
  // and Metrics reports of other job ids are ignored, and so are metrics whose site, stage or step does
  // not fit the plan and the site's earlier reports (they would forge the progress).
  void BeginJob(const std::string& job_id, std::map<std::string, int> stages = {});
  void Send(const std::string& site, v1::Command c);
  // Every heartbeat answer from now on carries the step boundary and the sites left out (SetBoundary in
  // run_machine.h); step 0 clears both.
  void SetBoundary(const std::string& job_id, int64_t step, std::vector<std::string> left_out = {});
  // Every heartbeat answer from now on carries the step lease (SetLease in run_machine.h).
  void SetLease(const std::string& job_id, int64_t steps, bool abandoned);
  // Every heartbeat answer from now on names these sites as allowed to probe (a site joining mid-run).
  void SetProbers(std::set<std::string> sites);
  void StopAll();
  // Registered sites whose last heartbeat is older than the spec's heartbeat timeout at `now` (a site
  // whose stage is done may exit: it is never silent).
  std::vector<std::string> Silent(Clock::time_point now) const;
  // A copy of the state (for printing).
  std::map<std::string, Site> Snapshot() const;
  Progress progress() const;
  const core::ClusterSpec& spec() const { return spec_; }

 private:
  int NumStages() const;  // of the running plan; REQUIRES: mu_ held
  void AddEventLocked(const std::string& kind, const std::string& site,
                      const std::string& text);  // REQUIRES: mu_ held
  // What an uploaded stage JSON (`part`) claims; checked against the plan and its writer's shard under mu_.
  struct StageMetaClaims {
    int stage = 0, num_stages = 0;
    int replica = -1;  // a replica's round state: its replica
    std::string sha256;
  };
  static absl::StatusOr<StageMetaClaims> ReadStageMeta(const std::string& site, const std::string& path,
                                                       const std::string& part, bool replica);
  // Writes step-S/manifest.json once every stage's writer sent both files of `step`, and again as each
  // replica's round state completes. REQUIRES: mu_ held.
  void WriteManifestIfComplete(int64_t step, const std::string& step_dir);

  core::ClusterSpec spec_;
  std::string run_id_;
  EventQueue* events_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Site> sites_;
  Progress progress_;
  std::string job_id_;
  std::string boundary_job_;           // SetBoundary
  std::vector<std::string> left_out_;  // SetBoundary
  int64_t boundary_step_ = 0;
  std::string lease_job_;  // SetLease
  int64_t lease_steps_ = 0;
  bool lease_abandoned_ = false;
  std::set<std::string> probers_;      // SetProbers
  std::map<std::string, int> stages_;  // the running attempt's plan: site -> stage
  // The run's information and history (SetRunInfo, SetRunFacts, RecordStep, RecordEvent): guarded by mu_.
  std::string profile_json_, graph_json_, plan_json_;
  nlohmann::json plan_, links_;                    // plan_json_ parsed, and profile_json_'s links
  std::map<std::string, double> gemm_flops_;       // each measured site's GEMM speed (profile_json_)
  int64_t total_steps_ = 0, tokens_per_step_ = 0;  // SetRunFacts
  std::deque<nlohmann::json> steps_, run_events_;  // RecordStep (with "seq"), RecordEvent: the newest kept
  int64_t step_seq_ = 0;                           // steps recorded so far
  std::ofstream event_log_;                        // SetEventLog's file
  std::string file_dir_;                           // guarded by mu_, as the three below
  std::map<std::string, int> file_writers_;
  std::map<std::string, std::pair<int, int>> round_writers_;  // site -> (stage, replica)
  int64_t file_max_step_ = 0, file_max_bytes_ = 0;
  int checkpoint_interval_ = 0;
  int64_t resume_step_ = 0;
  std::map<std::string, std::set<std::string>> readable_;  // site -> the run files it may fetch
  int64_t quota_bytes_ = 0;                                // 0: none
  struct StepUploads {  // what the writers of the running attempt sent of one checkpoint step
    // By (stage, replica): replica -1 for the stage's own files, R >= 0 for replica R's round state.
    std::map<std::pair<int, int>, std::string> shard_sha256, meta_sha256;
    bool manifested = false;
  };
  std::map<int64_t, StepUploads> uploads_;
  std::string log_dir_;                             // guarded by log_mu_
  std::map<std::string, std::ofstream> log_files_;  // by site, guarded by log_mu_; lines are flushed
  std::mutex log_mu_;                               // never taken while mu_ is held
  bool stopping_ = false;
};

}  // namespace meridian::coordinator

#endif  // MERIDIAN_COORDINATOR_COORDINATOR_H_
