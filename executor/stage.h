// One pipeline stage of a distributed run: runs its slice of the model under a 1F1B schedule,
// receiving activations from the previous stage and gradients from the next over the peer streams
// (rpc/peer.h), compressed with the link's codec (gradients with error feedback when lossy), then joins
// the global gradient-norm reduction along the pipeline and steps AdamW. Confined to one thread;
// the PeerService that feeds its inbox runs on gRPC's threads.
#ifndef MERIDIAN_EXECUTOR_STAGE_H_
#define MERIDIAN_EXECUTOR_STAGE_H_

#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "compression/activation_delta.h"
#include "compression/codec.h"
#include "executor/checkpoint.h"
#include "executor/diloco.h"
#include "executor/receive_ahead.h"
#include "executor/replica_sync.h"
#include "executor/site_group.h"
#include "executor/trainer.h"
#include "executor/zero.h"
#include "partitioner/schedule.h"
#include "rpc/peer.h"

namespace meridian::executor {

// The sites that run one stage, in replica order, and how many of each step's micro-batches each runs
// (micro-batch m runs on site partitioner::MicroBatchOwners(micro_batches)[m]).
struct StageSites {
  std::vector<std::string> sites, addresses;
  std::vector<int> micro_batches;  // per site; empty: shared equally
};

// What a stage needs to know about its place in the plan (the coordinator's StageAssignment, or a JSON
// file in static mode: docs/executor.md).
struct StageAssignment {
  std::string job_id = "job";
  int stage = 0, num_stages = 1;
  int first_op = 0, last_op = 0;
  std::string prev_site, next_site, prev_address, next_address;
  std::string forward_codec = "identity";   // activations to the next stage
  std::string backward_codec = "identity";  // gradients to the previous stage
  // Replicas (data parallel across sites). Empty `replicas`: this site alone; empty prev_replicas /
  // next_replicas: the single prev_site / next_site. A stage's replicas sum their gradients each step.
  StageSites replicas, prev_replicas, next_replicas;
  std::string gradient_codec = "identity";  // replica gradient sync
  // The previous stage's forward_codec: its activations arrive as AQ-SGD delta messages exactly when this
  // is a delta codec (another frame is then refused, and so is a delta message otherwise).
  std::string prev_forward_codec = "identity";
  int64_t bucket_bytes = 4 << 20;  // replica gradient buckets
  // Micro-batches this stage keeps in flight (partitioner::PipelineSchedule); 0: 1F1B's num_stages - stage.
  // The stages of a pipeline must not increase it from one stage to the next (the planner's never do).
  int in_flight = 0;
  // Activation recomputation: the forward pass runs without keeping its activations (only its input is
  // kept) and runs again, recording them, just before the micro-batch's backward pass. The same
  // arithmetic in the same order, so the same gradients; a third more compute for less memory.
  bool recompute = false;
  // DiLoCo over whole-pipeline replicas: every stage of the plan has the same number of replicas (at least
  // two) with the same micro-batch shares, so pipeline r -- replica r of every stage -- keeps its
  // micro-batches to itself (the coordinator sets it from the whole plan; ResolveReplicas checks the
  // neighbours). Each pipeline is then an independent DiLoCo worker between outer syncs: it clips by its own
  // gradient norm, summed along its own stages, and only its share of the step's loss goes to stage 0's
  // replica 0, off its path. Without it the replicas of every stage share one norm each step.
  bool whole_pipelines = false;
  // Bytes each neighbour's send queue holds before the compute thread waits (rpc::QueuedSender): a bound
  // on what this stage keeps for a slow link. 1 makes every send wait for the previous one to be written.
  int64_t send_queue_bytes = int64_t{256} << 20;
};
absl::StatusOr<StageAssignment> ParseAssignmentJson(const std::string& text, const std::string& path);

// Fills the defaults of `a` for site `self` with `micro_batches` per step (the groups above from the
// single-site fields, equal shares) and checks it: `self` among the replicas, shares summing to the
// step's micro-batches, an address for every other site, no site in two groups. Errors name the field.
absl::Status ResolveReplicas(StageAssignment* a, const std::string& self, int micro_batches);

// Runs one stage's part of each step: partitioner::PipelineSchedule(stage, num_stages, M, in_flight).
// A replica of a stage runs the entries of its own micro-batches in that order: each replica's order is
// then a subsequence of a deadlock-free single-pipeline order, so the replicated pipeline cannot
// deadlock. Sends to the neighbouring stages go through a rpc::QueuedSender per neighbour: the compute
// thread encodes a tensor and queues its frame, and waits only when that neighbour's queue is full.
// Receives are taken from the inbox and decoded ahead of the compute thread, in the schedule's order, by
// a ReceiveAhead per step.
//
// Every public entry returns a Status: libtorch's exceptions are caught at its edge (torch_boundary.h).
// What a DiLoCo replica last synchronised (StageWorker::last_outer_sync()).
struct OuterSyncReport {
  int64_t after_step = 0;  // 1-based inner step after which it began
  int64_t wire_bytes = 0;
  double seconds = 0, drift = 0;
};

class StageWorker {
 public:
  // Builds the stage's slice of the model on `device`. A failure that needs the network or the weights
  // (bad codecs, replicas, weights that do not load) is reported by Connect(); an exception while
  // building (the slice does not fit in memory) is returned here.
  static absl::StatusOr<std::unique_ptr<StageWorker>> Create(JobSetup setup, StageAssignment assignment,
                                                             rpc::TensorInbox* inbox, std::string certs_dir,
                                                             std::string self, torch::Device device,
                                                             std::chrono::seconds step_timeout);
  // Where AQ-SGD's activation spill files go (delta codecs, compression/activation_delta.h); default: the
  // system's temporary directory (TMPDIR). Call before the first Step.
  void set_scratch_dir(std::string dir) { scratch_dir_ = std::move(dir); }
  // A site of several devices (executor/site_group.h): this worker is `group`'s worker group->rank() and
  // runs its rows of every micro-batch; worker 0 alone talks to the other sites. With job.optimizer.zero 1
  // the AdamW moments are sharded across the workers (executor/zero.h). Call before Connect and Restore on
  // every worker; `group` must outlive this object. With DiLoCo, worker 0 alone holds the outer state and
  // exchanges with the other replicas; the other workers take the parameters it sets.
  absl::Status JoinSite(SiteGroup* group);
  // Whether this stage can run on a site of `workers` workers (JoinSite's checks, before any is started):
  // every worker needs a row of each micro-batch.
  absl::Status CanSplit(int workers) const;
  // Opens the streams to the neighbours' sites and to this stage's other replicas (they may still be
  // starting: waited for up to the timeout). Workers other than 0 of a site open none.
  // First reports a failure to load the model directory's weights for this slice, if there was one.
  absl::Status Connect();
  // Runs optimizer step `step` of `total_steps`: this replica's micro-batches in the stage's schedule,
  // the replicas' gradient sum, the global gradient norm, AdamW. Returns the step's mean loss on the first and last
  // stages, nullopt elsewhere. Every error names the stage, the peer and the tensor involved.
  // With job.step_overlap it also begins step + 1's early micro-batches (EarlyMicroBatches), which the next
  // call, Step(step + 1), finishes; a call for any other step (after a Restore, or a new attempt) drops them.
  // After a Restore from a switch's boundary that kept their weights, the first Step runs its early
  // micro-batches itself, on those weights (KeepsEarlyWeights).
  absl::StatusOr<std::optional<double>> Step(int64_t step, int64_t total_steps);
  // Closes the outgoing streams (waits for the neighbours' acknowledgements).
  absl::Status Finish();
  std::map<std::string, torch::Tensor> Parameters() const;
  // The largest frame this stage's peers can rightly send it, by direction: its micro-batch's activations
  // (or their gradients), a replica gradient bucket (at least its largest parameter), a control message.
  // The peer service refuses frames claiming more (PeerService::SetFrameBounds).
  rpc::FrameBounds ExpectedFrames() const;
  // Fault injection (ExecutorOptions::fault_nan_gradient_step): the first activation gradient this stage
  // sends at step `step` is all NaN. nan_gradient_sent() says whether it was.
  void InjectNanGradientAt(int64_t step) { nan_gradient_step_ = step; }
  // The last step this run will take (0-based), when it ends before the job's last step: DiLoCo then
  // synchronises every fragment after it, as after the job's last, so the replicas end equal.
  void set_final_step(int64_t step) { final_step_ = step; }
  // At a plan switch's step boundary, after Step(step) (every worker of every replica of the stage reaches
  // it: the coordinator's boundary is the same for all): DiLoCo synchronises every fragment, as after the
  // run's last step (OuterSync::FinishAtBoundary), so that every replica leaves the boundary with the outer
  // parameters and the next plan, of any layout, keeps what each replica learnt in the round. Call before
  // SaveCheckpoint. A no-op without DiLoCo and once a replica was left out (each survivor then keeps its
  // own progress; a new layout resumes replica 0's). Errors as Step's.
  absl::Status SynchroniseAtBoundary(int64_t step);
  // DiLoCo workers of a one-stage plan (independent between outer syncs, docs/sync.md): when another
  // replica stops answering (its loss share or an outer exchange fails as Unavailable), the worker asks
  // `left_out` for up to `wait` whether the coordinator left that site out. If so it goes on without it:
  // no loss share from it, no more outer syncs until the attempt's switch (OuterSync::Suspend), its
  // streams' errors at the end ignored. Otherwise the failure stands.
  // A worker that hears of a replica left out before anything failed gives up its exchange in flight and
  // suspends the outer syncs as well (the others do the same), so none waits for a part never sent.
  void set_left_out(std::function<std::set<std::string>()> left_out, std::chrono::milliseconds wait);
  bool nan_gradient_sent() const { return nan_gradient_sent_; }
  // DiLoCo (job.sync.mode: diloco, replicated stage): the last outer synchronisation applied; nullopt
  // before the first or without DiLoCo.
  std::optional<OuterSyncReport> last_outer_sync() const;
  // The checkpoint tensors Restore uses: each trained parameter and its two AdamW moments, by name, and
  // its early weights where KeepsEarlyWeights.
  std::set<std::string> CheckpointTensorNames() const;
  // Replica 0 of each stage writes the stage's checkpoint shards and weights (every-step replicas hold
  // the same; DiLoCo replicas the same at each round's end).
  bool writes_shard() const { return replica_ == 0; }
  // Whether SaveCheckpoint is to be called at checkpoint steps: replica 0's workers, and with DiLoCo
  // every replica's (each writes its round state).
  bool saves_checkpoints() const { return writes_shard() || diloco_; }
  // Writes this stage's shard of the checkpoint after `steps_done` steps (parameters and AdamW moments;
  // with DiLoCo the outer parameters and momentum), and with DiLoCo this replica's round state
  // (stage-K.replica-R.*: its own parameters and moments, and the outer exchange in flight;
  // OuterSync::ExportRoundState), so that the same replicas resume mid-round. An exchange in flight is not
  // waited for (a resumed replica runs it again), except at a plan switch's step boundary (`boundary`),
  // where the stages end: there it is awaited and its result saved (SynchroniseAtBoundary leaves none in
  // flight unless a replica was left out). The round state's JSON says `synchronised` when every fragment
  // was synchronised after the last step. With job.step_overlap outside DiLoCo a boundary's shard also
  // holds the weights the next step's early micro-batches began on (KeepsEarlyWeights).
  // The round state holds the replica's pseudo-gradient codec's error-feedback residuals; those of lossy
  // links and of every-step gradient sums are not saved (a resumed one starts empty). With `keep` > 0, stage 0's writer
  // -- one pruner per directory -- then keeps the newest `keep` complete steps of `dir` (PruneCheckpoints; what it
  // cannot remove goes to stderr).
  absl::Status SaveCheckpoint(const std::string& dir, int64_t steps_done, int keep = 0, bool boundary = false);
  // After resuming from step `step` of `dir`: stage 0's writer removes the step directories above it, so
  // what an abandoned attempt left there cannot mix with the steps written again (RemoveCheckpointsAbove).
  void ForgetCheckpointsAfter(const std::string& dir, int64_t step) const;
  // Loads this stage's parameters and moments by name from a checkpoint of any partition. On a site of
  // several workers only worker 0 reads `checkpoint` and sends the state to the others (collective).
  // A DiLoCo replica then takes its own round state (LoadRoundState in `checkpoint.path`) when its
  // stage's replicas resume theirs, and otherwise starts from replica 0's state, saying why.
  absl::Status Restore(const Checkpoint& checkpoint);
  // This stage as a DiLoCo round state describes it.
  core::ReplicaLayout RoundLayout() const;
  // The step the last Restore resumed at (worker 0's checkpoint's, on every worker of a site).
  int64_t restored_step() const { return restored_step_; }
  // Of the last Step: seconds spent waiting for the site's workers' gradient sum after the last backward
  // pass (0 on a site of one device).
  double last_site_reduce_seconds() const { return site_reduce_seconds_; }
  // AdamW moment elements this worker holds: the stage's two per trained element, or with ZeRO-1 its
  // shard's (ShardedAdamW::state_elements). Counts moments that exist (after the first step or a restore).
  int64_t optimizer_state_elements() const;
  int64_t wire_bytes() const { return wire_bytes_; }
  // Seconds the last Step spent computing (forward, loss, backward, clipping, optimizer): the step's time
  // without waiting for neighbours or encoding and sending.
  double last_compute_seconds() const { return compute_seconds_; }
  // Of the last Step, seconds the compute thread spent idle waiting for a peer (activations and gradients
  // not yet received and decoded, the gradient-norm exchange, the replicas' gradient sum); blocked by a
  // send (a full send queue, the replicas' small control messages); and encoding frames (on the compute
  // thread) plus decoding them (ahead of it, on the receiving thread: receive_ahead.h).
  double last_wait_seconds() const { return wait_seconds_; }
  double last_send_blocked_seconds() const { return send_blocked_seconds_; }
  double last_codec_seconds() const { return codec_seconds_; }
  // Of the last Step, CPU seconds (user and system), from the step's start to its end:
  //  - cpu: this process's, every thread (the compute thread, the senders, gRPC's and the receiving
  //    threads, heartbeats, intra-op threads where there are several, a checkpoint's upload);
  //  - compute_thread_cpu: the compute (calling) thread's, passes, encoding, data and bookkeeping;
  //  - compute_cpu: the compute thread's within its passes and optimizer step (what last_compute_seconds
  //    times by the wall clock; on a GPU, the host's share of launching them).
  // On a CPU site with one intra-op thread, cpu - compute_thread_cpu is the other threads' work -- the
  // transport's, mostly -- drawn from the same cores (an emulated site's quota) as the compute. On a site
  // of several devices, worker 0's process only.
  double last_cpu_seconds() const { return cpu_seconds_; }
  double last_compute_thread_cpu_seconds() const { return compute_thread_cpu_seconds_; }
  double last_compute_cpu_seconds() const { return compute_cpu_seconds_; }
  // Times the compute (calling) thread was preempted in the last Step (core::ThreadPreemptions).
  int64_t last_compute_thread_preemptions() const { return compute_thread_preemptions_; }
  int64_t raw_bytes() const { return raw_bytes_; }
  // Of wire_bytes()/raw_bytes(): what the replica gradient sync sent.
  int64_t replica_wire_bytes() const { return replica_wire_bytes_; }
  int64_t replica_raw_bytes() const { return replica_raw_bytes_; }
  // Replica gradient buckets synchronised so far, and how many were sent while backward still ran.
  int64_t replica_buckets() const { return replica_buckets_; }
  int64_t replica_buckets_during_backward() const { return replica_buckets_during_backward_; }

 private:
  StageWorker(JobSetup setup, StageAssignment assignment, rpc::TensorInbox* inbox, std::string certs_dir,
              std::string self, torch::Device device, std::chrono::seconds step_timeout);
  // `ids`: the micro-batch's training sequences, one per row (activations under a delta codec).
  absl::Status Send(const std::string& peer, const rpc::TensorKey& key, const torch::Tensor& t,
                    const compression::CodecSpec& codec, compression::ErrorFeedback* ef,
                    const std::vector<int64_t>* ids = nullptr);
  // Decodes a neighbour's frame (on ahead_'s thread): an activation message of AQ-SGD deltas against
  // `e.ids` with that peer's store (delta_in_, touched by nothing else), anything else directly.
  absl::StatusOr<torch::Tensor> Decode(const ExpectedTensor& e, const std::vector<uint8_t>& frame);
  // The next tensor of the step from a neighbouring site, decoded ahead (ahead_); waits for it at most the
  // step timeout, the time counted as waiting.
  absl::StatusOr<torch::Tensor> Receive(const std::string& peer, const rpc::TensorKey& key);
  // On a site of several workers: worker 0 receives the whole micro-batch's tensor and each worker gets its
  // rows; alone, Receive.
  absl::StatusOr<torch::Tensor> ReceiveRows(const std::string* peer, const rpc::TensorKey& key,
                                            const std::vector<int64_t>& shape);
  // The whole micro-batch's tensor from every worker's rows, at worker 0 (undefined at the others); alone, `t`.
  absl::StatusOr<torch::Tensor> GatherRows(const torch::Tensor& t, const std::vector<int64_t>& shape);
  bool talks_to_sites() const { return !group_ || group_->rank() == 0; }
  absl::Status RestoreSite(const Checkpoint& checkpoint);
  // job.step_overlap outside DiLoCo: a switch's boundary checkpoint keeps the weights the next step's early
  // micro-batches began on (`early.NAME` for each trained parameter), and a stage resumed from it runs
  // them on those, so the switch changes nothing that is computed (docs/executor.md, "Step overlap").
  bool KeepsEarlyWeights() const;
  // Those weights from `tensors` into a new early_model_: true when loaded, false when the checkpoint kept
  // none (or they are not kept), an error naming `path` when it kept only some or one does not fit.
  absl::StatusOr<bool> LoadEarlyWeights(const std::map<std::string, torch::Tensor>& tensors, const std::string& path);
  // Step `step` (0-based: the checkpoint's step count) runs its early micro-batches on early_model_; logs it.
  void ResumeEarlyMicroBatches(int64_t step);
  compression::ActivationStore::Options DeltaStore(const std::string& peer, const char* side) const;
  absl::StatusOr<std::unique_ptr<rpc::PeerClient::OutStream>> OpenStream(const std::string& site,
                                                                         const std::string& address);
  std::string Where() const;
  // Warns (the site log) when frames replaced waiting ones since the last report: rpc::TensorInbox::replaced.
  void ReportReplacedFrames(int64_t step);

  JobSetup setup_;
  StageAssignment a_;
  rpc::TensorInbox* inbox_;
  int64_t replaced_seen_ = 0;  // inbox_->replaced() when last reported (at construction first)
  std::string certs_, self_;
  torch::Device device_;
  std::chrono::seconds timeout_;
  std::unique_ptr<StageModel> model_;
  absl::Status init_status_;
  AdamW opt_;
  compression::CodecSpec fwd_codec_, bwd_codec_, grad_codec_;
  int replica_ = 0;                                   // this site's index in a_.replicas
  std::vector<int> owner_, prev_owner_, next_owner_;  // per micro-batch: the replica that runs it
  std::map<std::string, std::unique_ptr<compression::ErrorFeedback>> bwd_ef_;  // per previous-stage site
  std::map<std::string, std::unique_ptr<rpc::PeerClient>> clients_;
  // To this stage's other replicas: the first streams (gradient scatter), the second (gradient sums,
  // loss and norm messages). The neighbours' streams are inside senders_.
  std::map<std::string, std::unique_ptr<rpc::PeerClient::OutStream>> streams_, replica_streams_;
  std::map<std::string, std::unique_ptr<rpc::PeerClient::OutStream>> diloco_streams_;  // DiLoCo's sums
  std::map<std::string, std::unique_ptr<rpc::QueuedSender>> senders_;                  // to the neighbours' sites
  // AQ-SGD: per next-stage site, the activations it reconstructed; per previous-stage site, ours.
  std::map<std::string, std::unique_ptr<compression::DeltaEncoder>> delta_out_;
  std::map<std::string, std::unique_ptr<compression::DeltaDecoder>> delta_in_;
  bool said_delta_fallback_ = false;
  bool prev_delta_ = false;  // the previous stage sends AQ-SGD delta messages (prev_forward_codec)
  std::string scratch_dir_;
  std::unique_ptr<GradientAverager> averager_;  // with more than one replica, every_step sync
  // With more than one replica, diloco sync (diloco_); on a site of several devices only worker 0 holds
  // it, and the others take its parameters after each synchronisation applied.
  std::unique_ptr<OuterSync> outer_;
  bool diloco_ = false;
  int64_t outer_applied_seen_ = 0;        // worker 0: outer_->applied() when the workers last took its parameters
  bool outer_gave_up_ = false;            // worker 0: this step's exchange failed and was given up (a replica left out)
  SiteGroup* group_ = nullptr;            // a site of several devices (JoinSite)
  std::unique_ptr<SiteReducer> reducer_;  // with group_: the workers' gradient sum
  std::unique_ptr<ShardedAdamW> zero_;    // with group_ and job.optimizer.zero 1, instead of opt_
  int64_t restored_step_ = 0;
  double site_reduce_seconds_ = 0;
  int own_micro_batches_ = 0;  // diloco: this replica's micro-batches per step
  int64_t wire_bytes_ = 0, raw_bytes_ = 0, replica_wire_bytes_ = 0, replica_raw_bytes_ = 0;
  int64_t nan_gradient_step_ = -1;
  int64_t final_step_ = -1;
  std::function<std::set<std::string>()> left_out_source_;  // set_left_out
  std::chrono::milliseconds left_out_wait_{0};
  std::set<std::string> left_out_;  // replicas this worker goes on without
  // Whether the coordinator left out `peer` (empty: any other replica) within left_out_wait_; records every
  // replica it left out in left_out_, and suspends the outer syncs.
  bool AwaitLeftOut(const std::string& peer, const absl::Status& cause);
  // DiLoCo after inner step `step` (a no-op without it): the fragment due, if any (kAfterStep); every
  // fragment after the run's last step (kLastStep) or at a step boundary (kBoundary); then worker 0's
  // parameters to the site's other workers when an exchange changed them. Step's thread.
  enum class OuterPoint { kAfterStep, kLastStep, kBoundary };
  absl::Status SynchroniseOuter(int64_t step, OuterPoint point);
  // DiLoCo, resuming from replica 0's state: whether `tensors` (a checkpoint's) hold at least one of this
  // stage's parameters with its outer value ("outer.param.NAME") and every such one equal to it -- the
  // checkpoint was written right after every fragment was synchronised (a step boundary's), which every
  // replica took part in.
  bool ParametersEqualTheirOuterValues(const std::map<std::string, torch::Tensor>& tensors) const;
  // DiLoCo workers of the whole model (a one-stage plan): independent between outer syncs, and the ones a
  // lost replica can be left out of.
  // On a site of several devices only worker 0 holds outer_: this is false on the others, so no
  // collective of the site's workers may depend on it (diloco_ is the same on every worker).
  bool IndependentWorkers() const { return outer_ && a_.num_stages == 1; }
  // DiLoCo pipelines of several stages (StageAssignment::whole_pipelines): each exchanges its gradient norm
  // along its own stages only.
  bool PipelineWorkers() const { return outer_ && a_.whole_pipelines && a_.num_stages > 1; }
  // Whether a lost replica (worker or pipeline) can be left out and the others go on without it
  // (set_left_out): DiLoCo workers of the whole model, or whole pipelines.
  bool LeavesOutLostReplicas() const { return IndependentWorkers() || PipelineWorkers(); }
  // The other replicas of this stage among `sites`.
  std::vector<std::string> OtherReplicasIn(const std::set<std::string>& sites) const;
  bool OtherReplicaLeftOut() const;  // left_out_source_ names another replica of this stage now
  bool nan_gradient_sent_ = false;
  int64_t replica_buckets_ = 0, replica_buckets_during_backward_ = 0;
  double compute_seconds_ = 0, wait_seconds_ = 0, send_blocked_seconds_ = 0, codec_seconds_ = 0;
  double cpu_seconds_ = 0, compute_thread_cpu_seconds_ = 0, compute_cpu_seconds_ = 0;
  int64_t compute_thread_preemptions_ = 0;
  ReceiveAhead* ahead_ = nullptr;  // the running Step's receiver (a local of Step), else null
  // A micro-batch between its forward and backward passes: its input, and its output (the loss at the last
  // stage) with the autograd graph behind it; under recomputation no output, and at the last stage the
  // targets to compute the loss again. `model`: the weights it runs on (model_, or early_model_).
  struct MicroBatchState {
    torch::Tensor input, output, targets;
    StageModel* model = nullptr;
  };
  // job.step_overlap (docs/executor.md, "Step overlap"): early_model_ holds the weights of the step that
  // began the early micro-batches (made at the first, or by Restore from a switch's boundary that kept them;
  // its gradients are moved into model_'s once the step's
  // early micro-batches are all back). The next step's micro-batches begun by the last Step, for step
  // carried_step_: their states, and at the last stage the sum of their losses. A Step of another step (a
  // restore, another attempt) drops them.
  std::unique_ptr<StageModel> early_model_;
  // Restored at a switch's step boundary whose checkpoint kept early_model_'s weights (`early.NAME`): the
  // step whose early micro-batches Step runs on them itself, in the step (-1: none).
  int64_t resumed_early_step_ = -1;
  int64_t carried_step_ = -1;
  std::map<int, MicroBatchState> carried_;
  double carried_loss_ = 0;
  // A timeline of each step for diagnosis (docs/executor.md, "Step timelines"): with the environment
  // variable MERIDIAN_TRACE_DIR set, each Step appends one JSON line to
  // $MERIDIAN_TRACE_DIR/trace-<site>-stage<k>.jsonl: the step, its start (seconds since the first step's)
  // and its intervals [what, micro-batch, start, end] relative to the step's start, what being "F" / "B"
  // (a forward / backward pass), "wait_F" / "wait_B" (for an activation / a gradient), "wait_norm" (the
  // gradient-norm exchange), "opt" (clipping and the optimizer step), "data" (reading a micro-batch's tokens)
  // or "send" (encoding a tensor and queueing it; the full list in docs/executor.md). Worker 0 of a site only.
  struct TraceInterval {
    const char* what;
    int micro_batch;
    std::chrono::steady_clock::time_point start, end;
  };
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> trace_file_{nullptr, &std::fclose};
  std::vector<TraceInterval> trace_;
  std::optional<std::chrono::steady_clock::time_point> trace_epoch_;
  void Trace(const char* what, int micro_batch, std::chrono::steady_clock::time_point start) {
    if (trace_file_) trace_.push_back({what, micro_batch, start, std::chrono::steady_clock::now()});
  }
  void WriteTrace(int64_t step, std::chrono::steady_clock::time_point start);
};

}  // namespace meridian::executor

#endif  // MERIDIAN_EXECUTOR_STAGE_H_
