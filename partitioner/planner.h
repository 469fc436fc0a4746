// The planner: which contiguous slice of the operator graph runs at which site, in which order,
// with which replicas and which compression on each link, to minimise the predicted step time.
// The cost model is documented in docs/cost-model.md. All functions are pure and thread-safe.
#ifndef MERIDIAN_PARTITIONER_PLANNER_H_
#define MERIDIAN_PARTITIONER_PLANNER_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/cluster_spec.h"
#include "partitioner/model.h"

namespace meridian::partitioner {

// A compression choice for a link: name and ratio = compressed bytes / original bytes, for the
// activations; the gradients sent back over the link use `gradient_ratio` (0: the same as `ratio`).
struct Codec {
  std::string name;
  double ratio = 1.0;
  double gradient_ratio = 0;
  double backward() const { return gradient_ratio > 0 ? gradient_ratio : ratio; }
};

// Activation/gradient codecs between stages: compression::ActivationMenu(), least lossy first, each priced
// at its payload per float32 input byte (compression::PayloadRatio: int8 and int4 carry one float32 scale
// per block of 64).
// With `revisit_fraction` > 0 -- the share of a job's sequence visits that come back to a sequence seen
// before (fine-tuning epochs) -- the AQ-SGD codec int4-delta takes plain int4's place on the menu, at its
// expected ratio (int8 on first visits, int4 after), its gradients priced as int4 (int2-delta and plain
// int4 only with a fixed policy).
std::vector<Codec> DefaultLinkCodecs(double revisit_fraction = 0);
// Codecs for replica gradient sync: compression::GradientMenu() without top-k (see DefaultGradientCodecs
// in planner.cc), priced the same way.
std::vector<Codec> DefaultGradientCodecs();

// A codec of compression/ (CodecSpec::Parse's spelling) as the cost model prices it: its payload per
// float32 input byte; for an AQ-SGD delta codec, gradient_ratio prices the codec its gradients travel in
// (compression::GradientCodecBehind). InvalidArgument for a name that is not a codec.
absl::StatusOr<Codec> PriceCodec(const std::string& codec);

// How replicas synchronise (job.sync). Every step: the gradient sum, priced per step in the gradient
// menu's codec. DiLoCo: the same reduce-scatter + all-gather of pseudo-gradients in `codec`'s ratio (or
// SparseLoCo's all-gather), once every `inner_steps` steps; with `overlap`, each fragment's exchange runs
// beside the H / F steps until it is applied, so a step pays only what the exchanges take beyond the
// compute of those steps.
struct SyncModel {
  bool diloco = false;
  int inner_steps = 50;
  int fragments = 1;
  bool overlap = true;
  Codec codec{"int4", 0.140625};  // PriceCodec("int4"): half a byte an element and a float32 scale per 64
  // outer_optimizer sparseloco (docs/sync.md): an all-gather instead, each replica sending its whole
  // pseudo-gradient, top-k in `codec`, to every other replica (executor/replica_sync.h, sparse_sum).
  bool sparse_sum = false;
  // Sets sparse_sum; InvalidArgument when codec.name is not a top-k codec.
  absl::Status UseSparseSum();
};

// The job's `sync` section as the cost model prices it (an unknown codec keeps the default's price; the
// spec's validation has refused it already).
SyncModel SyncModelOf(const core::SyncSpec& spec);

struct PlanOptions {
  int micro_batches = 8;
  SyncModel sync;
  // Reference model (docs/cost-model.md): every link uses `ratio`, no replication.
  double ratio = 1.0;
  // Extensions; these two, deep_pipeline and recompute off give exactly the reference model.
  bool replication = false;           // data-parallel replicas of stages on otherwise unused sites
  bool adaptive_compression = false;  // per link, the lightest codec that keeps the link off the critical path
  // Each stage keeps as many micro-batches in flight as its round trip needs (within its memory), and
  // the step is predicted by simulating the executors' schedule over the plan (schedule.h) rather than
  // by the steady-state formula; layouts with fewer stages or more replicas are compared by that
  // simulation too. Off: 1F1B's depth and the formula.
  bool deep_pipeline = false;
  // Activation recomputation: a stage may run its forward pass again just before each backward pass,
  // keeping only each micro-batch's input in flight plus one micro-batch's activations, at the cost of a
  // second forward pass (ComputeFactor). Where a stage's memory cannot hold 1F1B's window otherwise, the
  // searches count it feasible so, at its time with the second pass; with deep_pipeline, a stage whose
  // memory holds fewer micro-batches than its round trip needs also takes it where that shortens the
  // simulated step by more than 1%. Off: never.
  bool recompute = true;
  std::vector<Codec> link_codecs = DefaultLinkCodecs();
  std::vector<Codec> gradient_codecs = DefaultGradientCodecs();
  // Gradient bytes = this * param_bytes (weights + grads) of the ops that train (optimizer_bytes > 0).
  double gradient_bytes_fraction = 0.5;
  // Search: exact dynamic programme up to this many sites, the documented heuristic beyond.
  int exact_max_sites = 8;
  bool force_heuristic = false;
  double exact_work_limit = 4e9;  // DP transitions; beyond it the heuristic's plan is kept, and said so
  // When non-empty, no search: this pipeline -- fixed_sites[k] (indices into the profile's sites) runs
  // stage k, which ends at op fixed_last_ops[k] -- is evaluated with the same cost model and returned as
  // the plan (ablations and pinned layouts, e.g. `meridian run --split even`). Same sizes; the last
  // entry of fixed_last_ops must be the graph's last op.
  std::vector<int> fixed_sites, fixed_last_ops;
  // With a fixed layout: more sites (indices) that replicate stage k, or empty; at most one entry per stage.
  std::vector<std::vector<int>> fixed_replicas;
  // With a fixed layout: how stage k's micro-batches are shared among its sites (one count per site, in
  // the order fixed_sites[k], fixed_replicas[k]..., summing to micro_batches), or empty for k (or for
  // every stage): in proportion to the profile's speeds (ShareMicroBatches).
  std::vector<std::vector<int>> fixed_shares;
  // job.optimizer.zero: 1 shards the optimizer state across a site's workers (SiteProfile::workers).
  int zero = 0;
  // job.step_overlap: K > 0 micro-batches of each step begin on the weights of the step before. Every stage
  // then holds a second copy of its weights and gradients (their weights), and keeps at most
  // MaxInFlightForOverlap(micro_batches, K) micro-batches in flight; a layout needing more for 1F1B's
  // window is infeasible. With deep_pipeline the predicted step is a steady overlapped step of the schedule
  // simulation (PipelineTimes::step_overlap); the reference formula does not count what the overlap hides.
  int step_overlap = 0;
};

// Pins `options` to a layout: stage k runs on sites[k][0], is replicated on sites[k][1...] and ends at op
// last_ops[k], its micro-batches shared as shares[k] says (empty or absent: by speed). The fields
// fixed_sites, fixed_last_ops, fixed_replicas and fixed_shares are replaced.
void PinLayout(const std::vector<std::vector<int>>& sites, const std::vector<int>& last_ops, PlanOptions* options,
               const std::vector<std::vector<int>>& shares = {});

// A pipeline layout read from a plan.json (`meridian plan --json`, a run's plan.json, or one written by
// hand): per stage, its sites (the first runs the stage, the others replicate it) and its last op.
struct PinnedStage {
  std::vector<std::string> sites;
  int last_op = 0;
  // The stage's "micro_batches", one count per site (as plan.json writes them), or empty: shared by speed.
  // Read only for a stage of several sites (a lone site runs every micro-batch).
  std::vector<int> micro_batches;
};
// Errors name `path` and the field: not JSON, no "stages", a stage without sites or last_op, a site named
// twice, last ops that do not increase, micro-batch counts that are not one non-negative integer per site.
absl::StatusOr<std::vector<PinnedStage>> ParsePlanLayout(const std::string& text, const std::string& path);

// The last op of each of `stages` stages that split `ops` ops into contiguous ranges of equal size (the
// first ones one op longer when it does not divide). REQUIRES: 1 <= stages <= ops.
std::vector<int> EvenCuts(int ops, int stages);

// How the M micro-batches of a step are shared among the replicas of a stage whose per-micro-batch
// seconds are `seconds` (one entry per replica): in proportion to speed, rounded by largest remainder
// (ties to the earlier replica). The counts sum to M; a replica may get 0 when M is small.
// REQUIRES: micro_batches >= 0, seconds non-empty, every entry > 0 (or all 0: equal shares).
std::vector<int> ShareMicroBatches(int micro_batches, const std::vector<double>& seconds);

// owner[m] = the replica (index into `counts`) that runs micro-batch m, for per-replica counts: smooth
// weighted round robin, so each replica's micro-batches are spread over the step rather than bunched
// (replica 0 first on ties). Every site computes the same owners from the same counts.
std::vector<int> MicroBatchOwners(const std::vector<int>& counts);

struct StagePlan {
  std::vector<int> sites;  // indices into ClusterProfile::sites; more than one = replicas
  std::vector<std::string> site_names;
  int first_op = 0, last_op = 0;   // inclusive range in topological order
  std::vector<int> micro_batches;  // per site of `sites`: micro-batches it runs each step (sum = M)
  double compute_seconds = 0;      // per micro-batch (replicas: slowest share / M)
  // Per micro-batch, beside compute_seconds on the compute thread: encoding and decoding the tensors
  // of its links (partitioner::CodecSeconds; with deep_pipeline, else 0). In plan.json when above 0.
  double codec_seconds = 0;
  // Per micro-batch, likewise: the transport work of the frames its passes send and receive on a CPU site
  // (partitioner::TransportSeconds; with deep_pipeline, else 0). In plan.json when above 0.
  double transport_seconds = 0;
  double memory_bytes = 0;            // needed on each of its sites
  double memory_available_bytes = 0;  // smallest among its sites
  double allreduce_seconds = 0;       // replica gradient sync per step, plus site_reduce_seconds
  std::vector<int> workers;           // per site of `sites`: its worker processes (SiteProfile::workers)
  double site_reduce_seconds = 0;     // of allreduce_seconds: the slowest site's workers' sum (c10d)
  std::string gradient_codec;         // codec for that sync
  // Micro-batches the stage keeps in flight (forward passes run whose backward pass has not): 1F1B's
  // S - k, or more with deep_pipeline (PipelineSchedule in schedule.h). memory_bytes counts them.
  int in_flight = 0;
  // Activation recomputation (PlanOptions::recompute): the stage keeps only its input per micro-batch in
  // flight and runs the forward pass again before each backward pass; compute_seconds excludes that
  // second forward pass (ComputeFactor gives the stage's time with it), memory_bytes counts the inputs.
  bool recompute = false;
  // Per step, its slowest site's norm, clipping and optimizer step (OptimizerSeconds; deep_pipeline, else 0).
  double optimizer_seconds = 0;
  // From the simulated schedule (deep_pipeline; else 0): seconds per step the stage computes and waits.
  double busy_seconds = 0, wait_seconds = 0;
};

// Whether `stages` are whole-pipeline replicas: more than one stage, each on the same number of sites (at
// least two) with the same micro-batch shares, so micro-batch m runs on replica r of every stage and
// pipeline r is replica r of every stage. Under DiLoCo such pipelines are independent between outer syncs
// (executor: StageAssignment::whole_pipelines; simulator/ likewise).
bool WholePipelineReplicas(const std::vector<StagePlan>& stages);

// Seconds per micro-batch that `site` computes stage `stage`'s passes: its ops' time (RangeSeconds), with
// a recomputing stage's second forward pass (ComputeFactor). What a site's reported compute time is
// compared with.
double StagePassSeconds(const OpGraph& graph, const SiteProfile& site, const StagePlan& stage);

// DiLoCo: the seconds one exchange of `stage`'s whole pseudo-gradient among its replicas takes, priced as
// the planner prices each outer synchronisation (sync's codec ratio; SparseLoCo's all-gather with
// sparse_sum; each site's sends sharing its uplink, plus the worst latency; `gradient_bytes_fraction` as
// PlanOptions'). 0 for a stage on one site; +infinity when two of its sites have no measured link.
double ExchangeSeconds(const OpGraph& graph, const ClusterProfile& profile, const SyncModel& sync,
                       const StagePlan& stage, double gradient_bytes_fraction = 0.5);

struct LinkPlan {
  int from_stage = 0;  // link between stage from_stage and from_stage + 1 (0-based)
  double bytes = 0;    // uncompressed bytes crossing the cut per micro-batch
  double seconds = 0;  // c_k: worst direction, compressed
  std::string codec;
  double ratio = 1.0;
};

// A layout the planner compared: per stage its sites (the first runs it, the others replicate it) and its
// last op, with the step the planner predicted for it (the simulated schedule with deep_pipeline, else the
// formula; before the final choice of link codecs by simulation).
struct PlanCandidate {
  std::vector<std::vector<int>> sites;
  std::vector<int> last_ops;
  double predicted_seconds = 0;
  // Whole DiLoCo pipelines (every stage sharing the micro-batches alike): the shares, per stage, to pin
  // with the layout (PinLayout); empty: by speed.
  std::vector<std::vector<int>> shares;
};

struct Plan {
  std::vector<StagePlan> stages;
  std::vector<LinkPlan> links;
  int micro_batches = 0;
  SyncModel sync;  // how the replicas synchronise (PlanOptions::sync); in plan.json as "sync"
  int zero = 0;    // PlanOptions::zero
  // PlanOptions::step_overlap (job.step_overlap); in plan.json as "step_overlap". meridian simulate runs
  // the executors' overlapped steps; so does predicted_step_seconds when `simulated` (PlanOptions::step_overlap).
  int step_overlap = 0;
  double predicted_step_seconds = 0;
  double fill_drain_seconds = 0;  // sum t_k + sum c_k
  double steady_seconds = 0;      // (M - 1) * bottleneck
  double sync_seconds = 0;        // slowest replica all-reduce
  double compute_bound_seconds = 0;
  // With deep_pipeline: predicted_step_seconds is the simulated schedule's step plus sync_seconds plus
  // optimizer_seconds, and formula_step_seconds is the steady-state formula's (fill_drain + steady + sync)
  // for the same plan.
  bool simulated = false;
  double formula_step_seconds = 0;
  // With deep_pipeline: the slowest stage site's norm, clipping and optimizer step (OptimizerSeconds;
  // 0 when the profile does not measure it).
  double optimizer_seconds = 0;
  std::string bottleneck;          // e.g. "stage 2 compute (oregon)"
  std::string method;              // "exact" or "heuristic"
  std::vector<std::string> notes;  // explanations: method, unused sites, compression choices
  // The distinct layouts compared after the search (the pipelines of each stage count, with and without
  // replicas), best prediction first; a fixed layout's is itself alone. `meridian plan --simulate K`
  // re-ranks them.
  std::vector<PlanCandidate> candidates;
};

// Plans `graph` over `profile`. Errors: InvalidArgument for inconsistent inputs (op_seconds naming an
// unknown op, micro_batches < 1); FailedPrecondition when no plan fits, naming what does not fit.
absl::StatusOr<Plan> PlanPipeline(const OpGraph& graph, const ClusterProfile& profile, const PlanOptions& options);

// The reference step time T of a given pipeline (one site per stage, fixed ratio, no recomputation), or
// +infinity when a memory limit or a missing link makes it infeasible. `last_ops[k]` is the last op of stage k; the
// final entry must be the last op of the graph. For tests and benchmarks that check the planner.
double ReferenceStepTime(const OpGraph& graph, const ClusterProfile& profile, int micro_batches, double ratio,
                         const std::vector<int>& sites, const std::vector<int>& last_ops);

// Human-readable table, JSON and Graphviz renderings of a plan.
std::string PlanTable(const Plan& plan, const OpGraph& graph, const ClusterProfile& profile);
std::string PlanJson(const Plan& plan, const OpGraph& graph);
std::string PlanDot(const Plan& plan, const OpGraph& graph);

}  // namespace meridian::partitioner

#endif  // MERIDIAN_PARTITIONER_PLANNER_H_
