// The run as a state machine: what `meridian run` decides, from the sites joining to the job's end, as a
// pure function of what happened. `std::vector<Action> Handle(const Event&)` takes one event (a site
// registered, a report arrived, a site went silent or came back, or time passed) and returns what to do
// (send commands, write run files, print, log). It does no I/O, starts no thread, takes no lock and never
// reads a clock: every event carries its time. So the recovery scenarios run in unit tests in
// milliseconds (coordinator/run_machine_test.cc), and the real loop (coordinator/run.cc) only moves
// events in and performs actions out.
//
// Phases: joining (until min_sites registered, or the join timeout) -> profiling (every joined site
// measures its device, the model and its links; with RunConfig::given_profile, nothing is measured) ->
// attempts (plan, assign, supervise) -> done or failed.
// Sites may also join mid-run, and stragglers be re-planned around (core::ElasticSpec), by the same switch.
// Such a switch, taken because a new plan predicts a faster step, is then checked against what it
// measures: when the new plan's steps run more than min_gain slower than the plan before it ran, the
// machine switches back to that layout and switches onto the same set of sites for speed no more.
// A site that asks to leave (SiteLeaving) while it runs a stage is switched away from at a step boundary:
// the machine picks a step S, every stage ends after step S with its checkpoint of S (switching), and the
// next attempt, planned without the site, resumes from exactly step S -- no step lost, none repeated; the
// site is then told to stop. The stages run on a step lease (SetLease), granted a few heartbeats' worth
// of steps ahead of the furthest stage as their reports come in, and S is the largest lease granted: a
// stage that hears of S late waits at its lease rather than pass S. Before an attempt's first report no
// lease is granted (the resume step may be unknown: each stage may load the newest intact checkpoint),
// so every stage stops after its first step, and a switch asked for meanwhile is placed there. Should
// the stages still not all end at S, the machine resumes from the newest intact checkpoint instead, as
// after a loss.
// When a site is lost during an attempt -- its heartbeats stop, or a stage fails and heartbeats then name
// a silent site -- the survivors abandon the attempt (draining), then the machine re-plans without the
// lost sites (on_failure: replan) or waits for them to return (wait), and every stage resumes from the
// newest intact checkpoint -- except a lost DiLoCo worker of a one-stage plan, or a lost site of a
// whole-pipeline DiLoCo plan (neither in replica 0 or pipeline 0, which write the checkpoints): the others
// leave that worker or pipeline out and go on to a switch without it (LeaveOutDilocoWorker).
//
// Thread-compatible: one thread (the run loop) owns a RunMachine.
#ifndef MERIDIAN_COORDINATOR_RUN_MACHINE_H_
#define MERIDIAN_COORDINATOR_RUN_MACHINE_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "core/checkpoint_dir.h"
#include "core/cluster_spec.h"
#include "partitioner/model.h"
#include "partitioner/planner.h"
#include "proto/meridian.pb.h"

namespace meridian::coordinator {

using Clock = std::chrono::steady_clock;

// ---- Events: what happened. ----
struct RunStarted {};  // the first event: the service listens, the join timeout starts
struct SiteRegistered {
  std::string site, listen, device;
};
struct ProfileReported {
  v1::ProfileReport report;
};
struct MetricsReported {
  v1::MetricsReport report;
};
struct StageReportedDone {
  v1::StageDone done;
};
struct HeartbeatLost {  // no heartbeat for the spec's timeout (a site whose stage is done is never lost)
  std::string site;
};
struct HeartbeatBack {  // a lost site heartbeats again
  std::string site;
};
// A site asks to leave at the next step boundary: `meridian drain`, or its executor got SIGTERM (a spot
// preemption notice). `why` says which, for messages.
struct SiteLeaving {
  std::string site, why;
};
struct Tick {};  // time passed
struct Event {
  Clock::time_point now;
  std::variant<RunStarted, SiteRegistered, ProfileReported, MetricsReported, StageReportedDone, HeartbeatLost,
               HeartbeatBack, SiteLeaving, Tick>
      what;
};

// ---- Actions: what to do, in order. ----
struct SendCommand {
  std::string site;
  v1::Command command;
};
struct StopAll {};  // every registered site gets a stop command
// The step lease of attempt `job_id` (the sites learn it from their heartbeats' answers): its stages
// complete at most `steps` steps until a later lease or a boundary; 0 grants nothing beyond each stage's
// first step of the attempt. Every boundary is placed at or after the largest lease granted, so no stage
// can have passed it. `abandoned`: the attempt is abandoned (draining), and a stage waiting for a lease
// ends at once.
struct SetLease {
  std::string job_id;
  int64_t steps = 0;
  bool abandoned = false;
};
// Sites that may probe their links to the running sites (a site joining mid-run); empty: none.
struct SetProbers {
  std::set<std::string> sites;
};
// The running attempt `job_id` ends once `step` steps are done, every stage saving its checkpoint of that
// step first (the sites learn it from their heartbeats' answers); step 0 clears it (but for `left_out`,
// kept with a boundary still to be placed). `left_out`: sites lost from the attempt whose DiLoCo workers
// the others go on without until then.
struct SetBoundary {
  std::string job_id;
  int64_t step = 0;
  std::vector<std::string> left_out;
};
// A new attempt at the job: from now on only its reports count and only `file_writers` (site -> the stage
// whose weights and checkpoint shards it writes) may send files, for steps up to `max_step`, of at most
// `max_file_bytes`.
struct BeginAttempt {
  std::string job_id;
  std::map<std::string, int> stages;  // every site of the plan -> its stage
  std::map<std::string, int> file_writers;
  int64_t max_step = 0, max_file_bytes = 0;
  // The coordinator's checkpoint store (0: not used): the job's interval, and the step the attempt
  // resumes from (Coordinator::SetFileWriters checks uploads and serves fetches against them).
  int checkpoint_interval = 0;
  int64_t resume_step = 0;
  // store: coordinator, resuming: the files of resume_step each site may fetch (its assignment's
  // resume_files).
  std::map<std::string, std::set<std::string>> readable;
  int64_t store_quota_bytes = 0;  // StoreQuotaBytes; 0: the store is not used
  // DiLoCo: each replica of a replicated stage -> (stage, replica): the round state it sends.
  std::map<std::string, std::pair<int, int>> round_writers;
};
// What `meridian status` and `meridian profile` show of the run (JSON).
struct PublishRunInfo {
  std::string profile_json, graph_json, plan_json;
};
// Writes (or, with `append`, appends to) the run directory's file `name` (core/run_layout.h).
struct WriteRunFile {
  std::string name, content;
  bool append = false;
};
struct Print {
  std::string text;  // whole lines, each ending in '\n'
  bool to_stderr = false;
};
struct LogSite {  // one line of RUN/sites/<site>.log
  std::string site, text;
};
// The coordinator's checkpoint store (job.checkpoint.store: coordinator), RUN/checkpoints:
// core::PruneManifested(keep, newest) and core::RemoveCheckpointsAbove(step).
struct PruneCheckpoints {
  int keep = 1;
  int64_t newest = 0;
};
struct RemoveCheckpointsAbove {
  int64_t step = 0;
};
// One entry of the run's event log (RUN/events.jsonl, the dashboard's and `meridian status --json`'s
// "events"): `kind` is one of "join", "profiled", "plan", "replan", "resume", "checkpoint",
// "stage_failed", "lost", "back", "recovery", "leave", "straggler", "switch", "switch_check", "done",
// "failed"; `site` names the site it concerns ("" for the run as a whole); `text` is the sentence shown.
// (The coordinator adds "checkpoint" events of its own store when a step's manifest is written.)
struct RecordEvent {
  std::string kind, site, text;
};
struct Exit {  // the run is over: stop the service; the process exits with `code`
  int code = 0;
};
using Action = std::variant<SendCommand, StopAll, SetBoundary, SetLease, SetProbers, BeginAttempt, PublishRunInfo,
                            WriteRunFile, Print, LogSite, PruneCheckpoints, RemoveCheckpointsAbove, RecordEvent, Exit>;

// What a run is given: the specs and `meridian run`'s options, already validated.
struct RunConfig {
  core::ClusterSpec spec;
  core::JobSpec job;
  // The job's operator graph, built by the coordinator from the job (job::ProfiledGraphOptions): the sites
  // report only their own devices, links and per-op times.
  partitioner::OpGraph graph;
  std::string job_yaml, job_dir;  // sent to the sites with every command
  int steps = 0, micro_batches = 0;
  double join_timeout_seconds = 0;  // 0: wait for the sites indefinitely
  int profile_repeats = 5;
  double probe_seconds = 1.0;  // each link's bulk probe, each way (--probe-seconds)
  // --profile: the sites' figures measured before (checked by CheckGivenProfile against this spec and
  // graph), planned from instead of measuring the sites that join; nullopt: the joined sites are measured.
  // A site of the spec that joins mid-run is measured as ever.
  std::optional<partitioner::ClusterProfile> given_profile;
  std::string given_profile_path;                // --profile, for messages
  bool even_split = false;                       // --split even (an ablation)
  std::string plan_path;                         // --plan, for messages
  std::vector<partitioner::PinnedStage> pinned;  // --plan's layout; empty: plan
  bool resume = false;                           // the first attempt resumes too
  // The share of the run's sequence visits that revisit a sequence (AQ-SGD's codecs pay then); nullopt:
  // the job's data has no sequences to revisit (synthetic).
  std::optional<double> revisit_fraction;
  double drain_seconds = 75;  // how long the survivors of an abandoned attempt get to end it
  // Attempts in a row that corrupt or non-finite data (a stage's DataLoss) may end before the run fails:
  // each resumes every stage from the newest checkpoint, which holds finite values only.
  int max_data_loss_recoveries = 2;
  std::string run_id;   // attempt k > 0 is "<run_id>-<k>"
  std::string run_dir;  // for messages
  // The newest manifested, intact checkpoint of the coordinator's store (core::FindLatestManifested of
  // RUN/checkpoints), with why newer steps were skipped; consulted when an attempt resumes with
  // job.checkpoint.store: coordinator.
  std::function<absl::StatusOr<core::CheckpointFiles>(std::string* skipped)> find_checkpoint;
};

// Checks a profile measured before (`meridian run --profile`, read from `path`) against the run it would
// plan: every site of `spec` and no other, each with its `workers` from the spec's devices and either no
// op times (priced by FLOPs) or a time for every op of `graph` and no other, and a link each way between
// every two of the spec's sites, none to a site outside it. Fills *usable with it, each site's memory
// capped at the spec's `memory:`. Errors name `path` and the site, op or link.
absl::Status CheckGivenProfile(const partitioner::ClusterProfile& profile, const std::string& path,
                               const core::ClusterSpec& spec, const partitioner::OpGraph& graph,
                               partitioner::ClusterProfile* usable);

// The most the coordinator's store (the run directory's checkpoints/ and weights/, with
// job.checkpoint.store: coordinator) may hold: job.checkpoint.keep + 2 steps (the kept ones, the one being
// written, the one arriving) and the final weights, each at most the model's training state (the graph's
// parameter and optimizer bytes; with job.step_overlap outside DiLoCo, the parameters once more: a
// switch's boundary keeps the early weights) plus 64 MiB of headers. Uploads beyond it are refused; `meridian run`
// checks it against the free space before any site joins.
int64_t StoreQuotaBytes(const RunConfig& config);

class RunMachine {
 public:
  explicit RunMachine(RunConfig config);

  // Takes one event; returns what to do. Events must come in time order.
  std::vector<Action> Handle(const Event& event);

  enum class Phase {
    kJoining,
    kProfiling,
    kTraining,
    kSwitching,  // ending the attempt at a step boundary to re-plan (a site leaves)
    kFailing,
    kDraining,
    kWaitingForReturn,
    kFinished
  };
  Phase phase() const { return phase_; }
  // The attempt running (or last run): "" before the first.
  const std::string& job_id() const { return job_id_; }
  // The current attempt's plan; nullopt before the first.
  const std::optional<partitioner::Plan>& plan() const { return plan_; }

 private:
  struct SiteState {
    bool registered = false;
    std::string listen, device;
    bool silent = false;
  };
  struct Attempt {                                     // what the current attempt's sites reported
    std::set<std::string> used;                        // the sites of its plan
    std::map<std::string, v1::StageDone> done;         // by site
    std::map<std::string, v1::MetricsReport> metrics;  // the latest, by site
    std::map<std::string, int> stage;                  // each site's stage in the plan
    // Replica 0 of stage 0: its reports carry the step's loss and drive the progress (other replicas of a
    // one-stage DiLoCo plan report their own share of it).
    std::string reporter;
    // The sites of DiLoCo workers or pipelines the others go on without (LeaveOutDilocoWorker): the lost
    // site, and in a pipeline its pipeline's other sites.
    std::vector<std::string> left_out;
    std::string failure, failed_site;         // the first stage error, or "no heartbeat"
    int failure_code = 0;                     // its absl::StatusCode
    std::set<std::string> failed;             // kFailing: every site whose stage reported an error
    Phase before_failing = Phase::kTraining;  // kFailing: the phase it interrupted
    std::string lost;                         // why it ended: the sites lost, for messages
    Clock::time_point deadline;               // kFailing: wait for heartbeats; kDraining: drain
  };

  void OnRegistered(const SiteRegistered& e);
  void OnProfile(const ProfileReported& e);
  void OnMetrics(const MetricsReported& e);
  void OnDone(const StageReportedDone& e);
  void OnLost(const HeartbeatLost& e);
  void OnBack(const HeartbeatBack& e);
  void OnLeaving(const SiteLeaving& e);
  // A site of the spec that registers after the sites were measured joins mid-run (core::ElasticSpec):
  // two heartbeat intervals later (the running sites then admit its probes) it measures its device, the
  // model and its links to the sites of the run while training goes on; the job is re-planned over all
  // sites and switched to at a step boundary when that gains more than min_gain.
  void MaybeMeasureJoiner();
  void OnJoinerProfile(const v1::ProfileReport& r);
  // A straggler's re-plan that moves work onto sites the current plan leaves idle first measures those
  // sites again (their device and the model; their figures date from the start, and a profile taken while
  // every emulated site measured at once can be far off): the switch is decided again, with their new
  // figures, once all have answered. OnRemeasured takes one answer.
  void OnRemeasured(const v1::ProfileReport& r);
  // `links_only`: probe the links to `peers`, the device and the model being measured already. `keep_busy`
  // (the first round, every site measuring at once): a CPU site keeps computing after measuring its model
  // until its next command, at most kKeepBusySeconds (ProfileRequest.keep_busy_seconds), so that no site's
  // last rounds run on a host the others have left quiet.
  v1::Command ProfileCommand(const std::string& site, const std::vector<std::string>& peers, bool links_only = false,
                             bool keep_busy = false) const;
  static constexpr double kKeepBusySeconds = 600;
  void OnTick();
  // kTraining -> kSwitching. `for_speed`: a new plan predicts a faster step (a straggler's or a joiner's
  // re-plan), so the switch is checked against what the new plan then measures (CheckSwitch).
  void BeginSwitch(const std::string& why, bool for_speed = false);
  // A switch for speed onto `fresh`: false, with an event and a line saying so, when a switch onto the same
  // sites measured slower than the plan before it earlier in the run, or when `fresh`'s layout (its sites,
  // stage by stage: LayoutOf) ran earlier in the run (measured_) and `fresh`'s prediction, scaled by what
  // that layout measured over its price then, is no more than min_gain faster than the current plan's
  // last `window` steps (`site`: whose change prompted it). `kind`: the event's ("straggler" or "join").
  // The switch check (CheckSwitch) alone does not stop two sites trading places: a switch it kept (within
  // min_gain) leaves the next flag free to take the run back to a layout that already measured slow.
  bool SwitchAllowed(const partitioner::Plan& fresh, const std::string& kind, const std::string& site,
                     const std::string& priced);
  // Takes the reporter's latest step: once the attempt after a switch for speed has run `window` steps
  // after its first, compares their median with the plan before's, and switches back when the plan
  // before was faster by more than min_gain.
  void CheckSwitch();
  // The furthest step any stage of the attempt reported done (0: none yet).
  int64_t Reached() const;
  // kTraining: grants the lease up to Reached() + SwitchMargin() (never less than before).
  void GrantLease();
  // kSwitching without a boundary yet (none was granted when it began): on the attempt's first report,
  // the boundary is the furthest step reported, since no stage may pass its first step without a lease.
  void PlaceBoundary();
  int64_t SwitchMargin() const;
  // A lost site of a one-stage DiLoCo plan other than replica 0 (the stage's writer), or of a
  // whole-pipeline DiLoCo plan (partitioner::WholePipelineReplicas) outside pipeline 0 (replica 0 of
  // every stage, the writers): the workers or pipelines are independent between outer syncs, so the
  // others leave it -- the whole pipeline r of a lost replica r -- out of their outer average (told
  // through the heartbeats' answers, SetBoundary::left_out) and go on to a switch that re-plans without
  // the lost site, no step lost. The lost pipeline's other sites fail when their neighbour goes: their
  // errors (`failed`, reported before the heartbeats named the lost site) are theirs alone and stop
  // nothing. Whether it did; false leaves the loss to the recovery from the newest checkpoint.
  bool LeaveOutDilocoWorker(const std::string& site, const std::set<std::string>& failed = {});
  // The sites of the DiLoCo worker or pipeline LeaveOutDilocoWorker would leave out for lost `site`
  // (empty: none can be).
  std::vector<std::string> DilocoPipelineOf(const std::string& site) const;
  // Stragglers (core::ElasticSpec): a used site's step compute against its planned share, relative to
  // the used sites' common ratio (the lower median of their typical ratios, each the median of a site's
  // latest `window` reports: what every site spends beyond the profile's op times -- the optimizer, the
  // framework -- cancels, and one site's spike moves no one else's; of two sites, once the site has
  // settled, the other's alone), and once it has settled under the
  // plan, against its own range over the first full window it spent within `drift` of the others too
  // (it must itself have changed), or
  // where the plan uses one site alone, relative to its own first `window` reports under the plan; once `window`
  // of its latest `window` + 1 reports are off by `drift` the same way (one step at full speed within a slowdown
  // does not start the window again), its op times are scaled by the median of those off (re-measured from the running
  // stage) and the job re-planned, switching when that gains more than min_gain. After a switch for speed, reports
  // count from the attempt's `window` + 2-th step on: the switch is checked (CheckSwitch) before anything is judged.
  void CheckDrift(const v1::MetricsReport& r);
  // Its ops x its micro-batches (with a recomputing stage's second forward pass), plus its optimizer step,
  // from profile_: what its reports' compute_seconds are compared with.
  double PlannedStepCompute(const std::string& site) const;
  int UsedSiteCount() const;                        // the sites of the plan's stages
  partitioner::ClusterProfile LiveProfile() const;  // profile_ without the excluded sites
  // DiLoCo: what a switch's step boundary adds to its deadline for the replicas' synchronisation there
  // (StageWorker::SynchroniseAtBoundary: the exchange in flight, then every fragment), priced as the planner
  // prices an exchange of the current plan's slowest stage; 0 otherwise.
  double BoundarySyncSeconds() const;
  partitioner::PlanOptions BaseOptions() const;  // the job's planning options, no layout pinned
  // A plan over LiveProfile() and the current plan's layout priced over it, with the same options (the
  // switch decisions compare their predicted steps). REQUIRES: plan_.
  struct Repriced {
    partitioner::Plan fresh, current;
    int sites = 0;  // in LiveProfile()
  };
  absl::StatusOr<Repriced> ReplanAgainstCurrent() const;
  // `layout`'s sites, cuts and replicas' shares (as assigned: a running stage keeps them) priced over `live`
  // (LiveProfile()) with the job's planning options; an error when one of its sites is not in it.
  absl::StatusOr<partitioner::Plan> PriceLayout(const partitioner::Plan& layout,
                                                const partitioner::ClusterProfile& live) const;
  void CompleteSwitch();  // every stage of the attempt ended while switching

  // The sites are measured in two rounds: every site's device and the model at once (they share this
  // host's cores when emulated, as they do when a plan runs them together), then, once all have
  // answered, the links (each pair once, probed by the lexicographically smaller site), so that no probe
  // lands in the quota of a site still timing its model.
  void StartProfiling();
  void StartLinkProbes();                           // every site measured its model: the links next
  void NextProbeRound();                            // the next round of disjoint link probes, or the plan
  void OnLinksProfile(const v1::ProfileReport& r);  // one answer of the second round
  // Checks one site's measurements before they are believed: its own device, op times of this model's
  // ops, links from or to itself and one of `probed` (the sites it was asked to probe), finite values.
  // The site's memory in *checked is capped at the spec's `memory:` for it, if set.
  absl::Status CheckProfile(const v1::ProfileReport& report, partitioner::ClusterProfile* checked,
                            const std::set<std::string>& probed) const;
  // The links of `site`'s report (profile.json's "links" entries) checked as CheckProfile does.
  absl::Status CheckLinks(const std::string& site, const std::string& links_json, const std::set<std::string>& probed,
                          std::vector<partitioner::LinkProfile>* checked) const;
  // Every answer is in and checked (a first-round error failed the run before any link was probed):
  // profile_ from them, then ProfileReady.
  void FinishProfiling();
  // --profile: profile_ from c_.given_profile's joined sites and the links between them, measuring
  // nothing; then ProfileReady. Fails the run when a site registered with another device than its
  // figures were measured on (SiteProfile::device, where recorded).
  void UseGivenProfile();
  // profile_ holds the joined sites' figures: the spec's link overrides applied, printed, profile.json and
  // graph.json written, then the first attempt. `how`: the "profiled" event's text.
  void ProfileReady(const std::string& how);
  void StartAttempt();
  absl::Status PlanAttempt();
  absl::Status FindResumePoint();
  void Assign();
  void ReportStep(const v1::MetricsReport& stage0);
  void EndAttempt();  // the attempt failed: recover or fail
  void AfterDrain();
  void Finish();
  void Fail(const std::string& message);

  void Out(Action a) { out_.push_back(std::move(a)); }
  void Say(std::string line) { Out(Print{std::move(line), false}); }
  void Note(std::string kind, std::string site, std::string text) {
    Out(RecordEvent{std::move(kind), std::move(site), std::move(text)});
  }
  std::vector<std::string> SilentUsed() const;  // the silent sites of the current attempt's plan
  size_t Registered() const;

  RunConfig c_;
  Phase phase_ = Phase::kJoining;
  Clock::time_point now_, join_deadline_, t0_;
  bool started_ = false;
  std::map<std::string, SiteState> sites_;                // every site of the spec
  std::vector<std::string> joined_;                       // the sites profiled, by name
  std::map<std::string, v1::ProfileReport> profiles_;     // the first round's answers
  bool probing_links_ = false;                            // the second round is under way
  std::map<std::string, std::set<std::string>> probing_;  // the probe round's sites yet to answer: their peers
  std::deque<std::map<std::string, std::set<std::string>>> probe_rounds_;  // the rounds after it (ProbeRounds)
  std::map<std::string, partitioner::ClusterProfile> checked_;             // each site's profile, checked
  partitioner::ClusterProfile profile_;
  std::string graph_json_;
  partitioner::OpGraph graph_;
  int64_t max_file_bytes_ = 0;
  std::set<std::string> lost_;  // re-planned around (on_failure: replan)
  std::optional<partitioner::Plan> plan_;
  int attempts_ = 0;
  std::string job_id_;
  bool resume_ = false;
  int64_t resume_step_ = 0;  // 0 afresh; -1 each stage loads the newest intact; S: step S
  // store: coordinator: the resume step's files, and the tensors each shard holds (when its JSON lists them).
  std::optional<core::CheckpointFiles> resume_files_;
  // The resume step's files that replica `replica` of stage `k` of the plan needs: every stage JSON, the
  // shards holding a tensor of one of its ops (a shard whose JSON lists no tensors: every stage), and its
  // own DiLoCo round state when the stage resumes them (ResumesRoundStates).
  std::vector<std::string> ResumeFilesFor(size_t k, size_t replica) const;
  // Whether stage k's DiLoCo replicas resume their own round states (all of them); else why, appended.
  bool ResumesRoundStates(size_t k, std::string* why) const;
  Attempt attempt_;
  int64_t progress_step_ = -1;  // the current attempt's last step reported by stage 0
  double last_loss_ = 0;
  int64_t tokens_ = 0;                          // over every attempt
  int64_t earlier_wire_ = 0, earlier_raw_ = 0;  // WAN bytes of the attempts before this one (stages count per attempt)
  int64_t pruned_at_ = 0;
  std::set<std::string> leaving_;             // asked to leave: in no plan from now on, stopped once they run no stage
  std::set<std::string> stopped_;             // leaving sites told to stop
  bool StopLeaving(const std::string& site);  // sends it the stop command once; whether it did now
  // The sites no plan may use: lost (re-planned around) or leaving.
  std::set<std::string> Excluded() const {
    std::set<std::string> out = lost_;
    out.insert(leaving_.begin(), leaving_.end());
    return out;
  }
  int64_t boundary_ = 0;  // kSwitching: the step the attempt ends after (0: to be placed, PlaceBoundary)
  // The current attempt's largest lease granted (0: none yet): SwitchMargin steps -- a few heartbeats'
  // worth -- ahead of the furthest stage when it was granted, and where a switch begun now ends the attempt.
  int64_t lease_ = 0;
  // A switch for speed, checked against what it measures (CheckSwitch).
  struct SwitchTrial {
    std::vector<partitioner::PinnedStage> before;  // the layout switched away from
    std::string before_layout;                     // it, for messages ("a -> b+c")
    double before_seconds = 0;                     // its median step over its last `window` steps
  };
  std::optional<SwitchTrial> switching_for_speed_;  // kSwitching for speed: the plan before, its steps still coming
  std::optional<SwitchTrial> trial_;                // the running attempt came from a switch for speed, unchecked
  // The running attempt came from a switch for speed (a new layout or new cuts): CheckDrift judges none of
  // its reports before its first `window` + 1 steps, the switch check's.
  bool after_switch_for_speed_ = false;
  std::vector<partitioner::PinnedStage> switch_back_;  // the layout the next attempt takes (a failed check)
  std::set<std::set<std::string>> refused_;            // sets of sites a switch for speed measured slower on
  // What each layout (LayoutOf) ended by a switch measured over its last `window` steps after its first
  // (recorded only with that many: the message's count is elastic.window), and its price then. A profile re-scaled from
  // a stage's reports puts the whole error on the site, while it can be the ops' own (ops costing more than profiled on
  // any site) or a passing disturbance: without this, the next plan moves those ops to the other site, which is flagged
  // in turn, and two sites trade places at every window, their figures inflating each time (docs/coordinator.md; a
  // RunMachine test). The latest record of a layout replaces the one before.
  struct Measured {
    double seconds = 0;     // the median step
    double priced = 0;      // the layout (its cuts too) priced over the profile when it ended, > 0
    int64_t last_step = 0;  // the last of the median's steps, 1-based
  };
  std::map<std::string, Measured> measured_;
  // The attempt's last `window` steps after its first (which warms up), those during which a site measured
  // itself mid-run left out (the cores were shared): fewer when it has not run that many.
  std::vector<double> RecentSteps() const;
  // The reporter's steps this attempt: seconds, and whether a site measured itself mid-run meanwhile.
  std::vector<std::pair<double, bool>> attempt_steps_;
  bool measured_in_step_ = false;  // a mid-run measurement ended since the reporter's last step
  bool MeasuringMidRun() const { return !remeasuring_.empty() || joiner_asked_; }
  int64_t switch_step_ = 0;            // the next attempt resumes from exactly this step (0: the newest intact)
  double last_step_seconds_ = 0;       // stage 0's latest step
  std::string joiner_;                 // the site joining mid-run being measured ("" none)
  std::set<std::string> remeasuring_;  // idle sites measured again before a straggler's switch (OnRemeasured)
  std::string remeasure_why_;          // that straggler's message
  Clock::time_point remeasure_deadline_;
  static constexpr double kRemeasureSeconds = 300;  // a measurement that takes longer drops the decision
  // Drops a re-measure decision that waits for `site` (lost, leaving, registered anew, or too slow).
  void DropRemeasure(const std::string& site, const std::string& why);
  Clock::time_point joiner_at_;  // when it may be asked to measure (its probes admitted by then)
  bool joiner_asked_ = false;
  // Ends the joiner's measuring (the running sites stop admitting its probes); returns its name.
  std::string EndJoinerMeasurement();
  // A joiner whose measuring failed (`what`): said, and not asked again until it registers again.
  void RefuseJoiner(const std::string& site, const std::string& what);
  Clock::time_point joiner_deadline_;     // when a joiner asked to measure that has not answered is dropped
  std::set<std::string> joiner_peers_;    // the sites it was asked to probe
  std::set<std::string> failed_joiners_;  // whose measuring failed (until they register again)
  struct Drift {
    // Its latest `window` + 1 reports' compute / planned (the median of the latest `window`: the site's
    // typical ratio).
    std::vector<double> recent;
    // The lowest and highest of its ratios over the first full window it spent within `drift` of the
    // others under the plan, or since its profile was last re-measured (0 until then): where it settled.
    double lo = 0, hi = 0;
    std::vector<double> window;  // the latest `window` + 1 ratios, each relative to the sites' common ratio
    // A site alone in the plan: its first `window` ratios under the plan after the first report (whose
    // step warms up: allocations, first calls), and then their median, which its later ratios are taken
    // relative to (there is no other site to compare it with).
    bool warmed_up = false;
    std::vector<double> first;
    double baseline = 0;
  };
  std::map<std::string, Drift> drift_;  // by used site, this attempt
  int data_loss_recoveries_ = 0;        // attempts in a row ended by corrupt or non-finite data
  int64_t data_loss_at_ = -1;           // the progress when the last of them ended
  std::vector<Action> out_;
};

}  // namespace meridian::coordinator

#endif  // MERIDIAN_COORDINATOR_RUN_MACHINE_H_
