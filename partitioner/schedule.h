// Pipeline schedules and their event simulation: which forward and backward passes a stage runs in
// which order, how many micro-batches it keeps in flight, and how long a step of such a schedule takes
// over given stage and link times. Shared by the planner (which chooses each stage's depth and predicts
// the step from the simulation) and the executor (which runs PipelineSchedule). Pure functions,
// thread-safe; docs/cost-model.md describes the model.
#ifndef MERIDIAN_PARTITIONER_SCHEDULE_H_
#define MERIDIAN_PARTITIONER_SCHEDULE_H_

#include <cstdint>
#include <utility>
#include <vector>

namespace meridian::partitioner {

// The order in which stage `stage` of `num_stages` runs the passes of `micro_batches` micro-batches:
// ('F', m) and ('B', m) entries. The stage first runs in_flight - 1 forward passes (the warm-up), then
// alternates one forward and one backward pass, then drains the backward passes; so at most `in_flight`
// micro-batches have run forward without their backward pass yet. in_flight <= 0 means 1F1B's
// num_stages - stage; it is clamped to [1, micro_batches].
//
// With sends that never block (the executor's queued senders) a pipeline whose stages run these orders
// cannot deadlock when in_flight does not increase from one stage to the next (stage k waits for a
// gradient that stage k + 1 produces after forward passes that stage k has already sent). 1F1B's
// num_stages - stage is such a sequence; ChooseInFlight returns only such sequences.
std::vector<std::pair<char, int>> PipelineSchedule(int stage, int num_stages, int micro_batches, int in_flight = 0);
// The depth PipelineSchedule keeps at that stage: `in_flight`, or 1F1B's num_stages - stage when it is
// <= 0, clamped to [1, micro_batches].
int InFlightOf(int stage, int num_stages, int micro_batches, int in_flight);

// A stage's part of one step under job.step_overlap (docs/executor.md, "Step overlap"): the first
// micro-batches of the next step begin within this one, on the weights this step uses. The stage runs
// PipelineSchedule over the step's micro-batches followed by the next step's first `k_next` (numbered
// M..M+k_next-1 there), as one 1F1B sequence, up to its last entry that is either this step's or a
// forward pass of the next step's; the entries of this step that the previous step's part ran (its
// `k_done` early micro-batches) are left out. `next` marks an entry of the next step, with `micro_batch`
// then counted in that step. Over consecutive steps every pass runs exactly once and at most in_flight
// micro-batches are in flight at any point, so pipelines that are deadlock-free under PipelineSchedule
// stay so (every stage cuts the same sequence at the same kind of point).
struct StepEntry {
  char kind;  // 'F' or 'B'
  int micro_batch;
  bool next;
  bool operator==(const StepEntry& o) const { return kind == o.kind && micro_batch == o.micro_batch && next == o.next; }
};
std::vector<StepEntry> OverlappedStepSchedule(int stage, int num_stages, int micro_batches, int in_flight, int k_done,
                                              int k_next);

// The deepest in-flight depth at which `k` early micro-batches (job.step_overlap) fit a step of
// `micro_batches`: each step's early micro-batches must finish their backward passes before the next
// step's first forward pass (their weights are replaced then), which holds when k <= micro_batches -
// in_flight + 1. At least 1.
int MaxInFlightForOverlap(int micro_batches, int k);

// DiLoCo (job.sync.mode: diloco; executor/diloco.h) with `inner_steps` H in `fragments` F synchronises
// one fragment every DilocoSyncPeriod inner steps, max(1, H / F): fragment f after inner step t (1-based)
// when t is a multiple of the period and (t / period) mod F == f. FragmentDueAfter: that fragment after
// inner step `step` (0-based), or -1 for none.
int DilocoSyncPeriod(int inner_steps, int fragments);
int FragmentDueAfter(int64_t step, int inner_steps, int fragments);

// job.step_overlap: how many of step `step`'s first micro-batches begin in the step before, on its weights.
// 0 -- an exact step -- for the first step, a step past the run (`total_steps`), a step after one that
// writes a checkpoint (every `checkpoint_interval` steps; 0: none) or that ends with a DiLoCo synchronisation
// point (every `sync_period` steps; 0: none); otherwise `k`. The executors, train-local and the simulator
// all ask this.
int EarlyMicroBatches(int k, int64_t step, int64_t total_steps, int checkpoint_interval, int sync_period);

// True when `in_flight` (one entry per stage, each >= 1) never increases from a stage to the next.
bool InFlightIsDeadlockFree(const std::vector<int>& in_flight);

// What one step of a pipeline costs, per micro-batch. Stage k sends activations over link k (k -> k+1)
// and receives gradients over it (k+1 -> k). Each direction of a link between two sites is a FIFO: a
// tensor starts when the previous one has left, takes its transfer seconds, and arrives one latency
// later. Between replicated stages, each pair of replicas that micro-batches go between has its own.
struct PipelineTimes {
  int micro_batches = 1;
  // Per stage, the compute thread's seconds per pass.
  std::vector<double> forward_seconds, backward_seconds;
  // Per stage (empty: none), the work each pass does on its frames at the site that runs it: decoding its
  // input and encoding what it sends (partitioner::CodecSeconds), the transport's CPU. A pass takes
  // forward_seconds (x a replica's replica_scale, below) plus this, which does not scale with a replica's
  // share of the stage's compute.
  std::vector<double> forward_frame_seconds, backward_frame_seconds;
  // Per stage (empty: none), the forward pass run again before each backward pass (activation
  // recomputation): it needs no gradient, so it starts as soon as the stage is free, and the backward
  // pass follows once the gradient has arrived.
  std::vector<double> recompute_seconds;
  std::vector<double> forward_transfer_seconds, backward_transfer_seconds;  // per link (S - 1 entries)
  std::vector<double> forward_latency_seconds, backward_latency_seconds;    // per link, one way
  std::vector<int> in_flight;  // per stage; empty: 1F1B (num_stages - stage)
  // Replicated stages (empty, or an empty entry: the stage runs on one site). owners[k][m] is the replica
  // of stage k that runs micro-batch m (partitioner::MicroBatchOwners), and replica r's passes take
  // replica_scale[k][r] times the stage's forward_seconds and backward_seconds, which are its combined pace
  // per micro-batch, plus the frames' work. As
  // the executors do, each replica runs the stage's PipelineSchedule filtered to its own micro-batches,
  // one pass at a time, so it keeps only its share of the stage's depth in flight.
  std::vector<std::vector<int>> owners;
  std::vector<std::vector<double>> replica_scale;
  // job.step_overlap (K > 0, below micro_batches): consecutive steps, each stage running its part of each
  // (OverlappedStepSchedule, the first step exact), the norm's exchange split around the next step's early
  // passes as the executors split it, and each stage's optimizer step (optimizer_seconds, per stage: its
  // slowest site's; empty: none) at the end of its part. 0: one exact step.
  int step_overlap = 0;
  std::vector<double> optimizer_seconds;
};

struct SimulatedStep {
  bool deadlocked = false;  // the schedules wait on each other (in_flight increases somewhere)
  // One exact step: to the end of the gradient-norm exchange (before the optimizer step). With
  // PipelineTimes::step_overlap: a steady step, the mean over the steps after the second from one step's end
  // (its last stage's optimizer step) to the next's, optimizer steps included; the figures below are over
  // each stage's part of the last step, its times counted from the earliest part's beginning.
  double step_seconds = 0;
  // Per stage; of a replicated stage, its busiest replica's, its longest-waiting replica's, and its last.
  std::vector<double> busy_seconds;    // per stage: forward, backward and send work
  std::vector<double> wait_seconds;    // per stage: idle between its first pass and its last
  std::vector<double> finish_seconds;  // per stage: end of its last pass
  std::vector<double> forward_link_busy_seconds, backward_link_busy_seconds;  // per link, its pairs summed
  // Per stage, the passes in the order they ran: (kind, micro-batch, start, end); a recomputation is an
  // 'R' pass before its micro-batch's 'B'. A replicated stage's replicas' passes one replica after another.
  struct Pass {
    char kind;
    int micro_batch;
    double start, end;
  };
  std::vector<std::vector<Pass>> passes;
};

// Simulates one step: every stage (every replica of a replicated stage) runs PipelineSchedule(k, S, M,
// in_flight[k]) in order (its own micro-batches of it), a pass starting when the stage (replica) is free
// and its input (activation or gradient) has arrived. Then the gradient norm
// travels from the last stage to the first and back (latency only), as the executors exchange it.
// With PipelineTimes::step_overlap, five consecutive steps (SimulatedStep::step_seconds): each stage (each replica)
// runs OverlappedStepSchedule's part of each; after the step's last backward pass it sends the norm's
// partial sum up once the next stage's has arrived (all of a stage's replicas together) and waits for it
// before the next step's early passes; at the end of its part it awaits the total (stage 0 sends it down at
// once, a later stage passes it on at the end of its own part), then runs its optimizer step, and only then
// its next part's passes on the new weights. docs/cost-model.md, "Step overlap".
// REQUIRES: the vectors sized as documented above (S >= 1 stages).
SimulatedStep SimulatePipeline(const PipelineTimes& times);

// Chooses each stage's in-flight depth: enough micro-batches to cover the stage's round trip (its own
// pass, every later hop's transfers and latencies both ways, the later stages' passes) at the pipeline's
// steady pace, as a TCP window covers the bandwidth-delay product; at least 1F1B's num_stages - k, at
// most `max_in_flight[k]` (memory) and the micro-batches, never increasing along the pipeline; then
// deepened or made shallower stage by stage while the simulated step gets shorter; finally made as
// shallow as it can be for at most 0.5% more simulated step (memory is worth more than that). Ranges of
// more than 32 depths are sampled (powers of two around the current depth; bisection when making it
// shallow), so that thousands of micro-batches plan in seconds.
// REQUIRES: max_in_flight[k] >= num_stages - k (1F1B fits), sizes as in PipelineTimes.
std::vector<int> ChooseInFlight(const PipelineTimes& times, const std::vector<int>& max_in_flight);

}  // namespace meridian::partitioner

#endif  // MERIDIAN_PARTITIONER_SCHEDULE_H_
