#include "simulator/simulator.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <queue>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "compression/activation_delta.h"
#include "compression/codec.h"
#include "nlohmann/json.hpp"
#include "partitioner/schedule.h"

namespace meridian::simulator {
namespace {

using partitioner::ClusterProfile;
using partitioner::OpGraph;
using partitioner::Plan;
using json = nlohmann::json;

constexpr double kControlBytes = 16;  // two float64: the gradient norm's square sum and the loss
// A sum over R replicas sends 2 R (R - 1) parts per bucket or chunk. Beyond this many transfers per sum,
// buckets (and DiLoCo chunks) are merged, so that hundreds of replicas simulate in seconds: the overlap
// of a gradient sum with the last backward pass is then coarser (a note says so).
constexpr double kMaxTransfersPerSum = 1 << 18;

// A tensor's codec as the simulator charges it: wire bytes per raw byte in each direction, and the name
// under which a site's codec_bytes_per_second prices its encoding.
struct LinkCodec {
  std::string name;
  double forward_ratio = 1, backward_ratio = 1;
};

LinkCodec CodecOf(const std::string& name, double ratio) {
  LinkCodec c{name, ratio, ratio};
  if (auto priced = partitioner::PriceCodec(name); priced.ok()) c.backward_ratio = priced->backward();
  return c;
}

// One stage replica: a site's compute thread and what it is doing.
struct Worker {
  int site = 0, stage = 0, replica = 0;
  double forward = 0, backward = 0;  // seconds per micro-batch
  // Activation recomputation: the forward pass again before each backward pass (0: none), run as soon as
  // the worker is free; `recomputed` once the current backward pass's has run.
  double recompute = 0;
  bool recomputed = false;
  double optimizer = 0;  // seconds per step after the norm: clipping and the optimizer step
  // The current step's passes (partitioner::OverlappedStepSchedule, this replica's), and after which of them
  // the norm's first half runs (after the step's last backward pass; the rest, with job.step_overlap, are
  // the next step's early micro-batches, run before the second half).
  std::vector<partitioner::StepEntry> order;
  size_t norm_at = 0;
  int in_flight = 0;
  int micro_batches = 0;
  // The current step.
  int step = -1;
  size_t next = 0;
  bool busy = false;
  int last_backward = -1;  // index into order of the last backward pass (the averager's capture)
  double step_start = 0;
  std::map<std::pair<int, int>, double> activations, gradients;  // (step, micro-batch) -> arrival
  std::map<std::pair<int, int>, double> control;                 // (step, sending worker) -> arrival
  // Phases after the passes: 0 passes, 1 gradient sum, 2 the norm's first half (partial sums up the
  // pipeline), 4 the next step's early passes (job.step_overlap), 5 the norm's second half (the total down
  // the pipeline), 3 done.
  int phase = 0;
  bool sent_up = false;
  bool sent_down = false;  // whole pipelines: the total to the next stage (and stage 0's loss share to replica 0)
  int buckets_done = 0;
  // The gradient sum's own CPU work (its codec and transport) ends no earlier than this.
  double sum_cpu_until = 0;
  // DiLoCo: an exchange this replica has begun and not yet received in full; what to do when it has.
  bool exchange_open = false;
  std::function<void(double)> resume;
  // Per-step statistics for the report.
  std::map<int, double> compute, codec, duration;
};

struct Event {
  double t;
  uint64_t seq;
  std::function<void()> fn;
  bool operator>(const Event& o) const { return t != o.t ? t > o.t : seq > o.seq; }
};

class Simulation {
 public:
  Simulation(const OpGraph& g, const ClusterProfile& p, const Plan& plan, const SimulationOptions& o)
      : g_(g), p_(p), plan_(plan), o_(o) {}

  absl::Status Init();
  // Simulates `steps` steps and `extra` more after them, which Result leaves out: with job.step_overlap a
  // step begins the next one's early micro-batches, so the last step simulated is not a steady one.
  void Run(int steps, int extra = 0);
  // After Run: the first site that did not finish every step (the schedules wait on each other), or "".
  std::string Stuck() const;
  SimulationResult Result(int steps);

 private:
  double CodecSeconds(int site, const std::string& codec, double raw_bytes) const;
  int WorkerOf(int stage, int micro_batch) const { return stage_workers_[stage][owners_[stage][micro_batch]]; }
  void At(double t, std::function<void()> fn) { events_.push({t, seq_++, std::move(fn)}); }
  // Queues `bytes` from site a to site b at time t (FIFO on the link and, when shared, a's uplink); calls
  // `left` when its last byte has left (optional) and `arrived` one latency later.
  void Transfer(int a, int b, double bytes, double t, Activity activity, std::function<void(double)> arrived,
                std::function<void(double)> left = nullptr);
  // A flow of `bytes` sent as chunks of `chunk` bytes, each queued when the previous one has left.
  void ChunkedTransfer(int a, int b, double bytes, double chunk, double t, Activity activity,
                       std::function<void(double)> arrived);
  void StartStep(int w, double t);
  void TryRun(int w, double now);
  void PassDone(int w, double start, double end, double codec);
  void RecomputeDone(int w, double start, double end);
  void AfterPasses(int w, double t);
  // A sum over the replicas of a stage (a gradient bucket, or a DiLoCo fragment): each replica, once it
  // contributes, sends part j to replica j; replica j, with every part and its own, sends the summed part
  // j to every other replica; a replica is done when it has every summed part.
  struct Reduction {
    std::string kind;  // "sync" or "outer_sync"
    double part_bytes = 0;
    double chunk_bytes = 0;  // > 0: parts travel in chunks of this size
    // SparseLoCo's sum (plan.json sync.sparse_sum): each replica sends its whole contribution (part_bytes)
    // to every other replica, and is done once it holds the others'; no summed parts go back.
    bool all_gather = false;
    std::vector<bool> contributed;
    std::vector<int> scattered, gathered;
    std::function<void(int replica, double t)> done;
  };
  using ReductionKey = std::tuple<int, int, int>;  // stage, step, bucket (>= 0) or -1 - fragment
  void Contribute(const ReductionKey& key, int replica, double t);
  void MaybeGather(const ReductionKey& key, int j, double t);
  void BucketReady(int stage, int step, int bucket, int replica, double t);
  void Advance(int w, double t);
  void SendControl(int from, int to, double t);
  void StepDone(int w, double t);
  void FinishStep(int w, double began_waiting, double t);
  void ExchangeBegin(int w, double t);

  const OpGraph& g_;
  const ClusterProfile& p_;
  const Plan& plan_;
  const SimulationOptions& o_;
  int steps_ = 0;
  std::vector<std::vector<double>> bw_, lat_, receive_;  // [from][to]; receive_: LinkProfile::receive_seconds_per_byte
  std::vector<double> uplink_;
  std::vector<std::vector<double>> link_free_;
  std::vector<double> uplink_free_;
  std::vector<Worker> workers_;
  std::vector<std::vector<int>> stage_workers_;  // stage -> worker indices in replica order
  std::vector<std::vector<int>> owners_;         // stage -> micro-batch -> replica
  // DiLoCo over whole pipelines (executor: StageAssignment::whole_pipelines): several stages, each replicated
  // alike with the same shares, so pipeline r is replica r of every stage and exchanges its norm alone.
  bool whole_pipelines_ = false;
  std::vector<LinkCodec> links_;       // per pipeline link
  std::vector<double> link_bytes_;     // raw bytes per micro-batch crossing each link
  std::vector<double> grad_bytes_;     // per stage: float32 gradient bytes
  std::vector<LinkCodec> grad_codec_;  // per stage: replica sum codec
  std::vector<int> buckets_;           // per stage
  bool coarse_ = false;                // buckets or chunks merged (kMaxTransfersPerSum)
  std::map<ReductionKey, Reduction> reductions_;
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events_;
  uint64_t seq_ = 0;
  std::vector<double> step_end_;  // per step: the last worker to start the next one
  double last_step_start_ = 0;    // the first worker to start the last step
  // What happened from step keep_from_ on (the last step, and the DiLoCo exchanges that may still run
  // during it): passes, waits and transfers (from, to, bytes), each with its times.
  struct Record {
    Activity activity;
    int from = -1, to = -1;
    double bytes = 0;
  };
  int keep_from_ = 0;
  int reported_steps_ = 0;  // Run's `steps`: the last of them is the reported step
  std::vector<Record> records_;
};

double Simulation::CodecSeconds(int site, const std::string& codec, double raw_bytes) const {
  return partitioner::CodecSeconds(p_.sites[site], codec, raw_bytes);
}

absl::Status Simulation::Init() {
  const int n = static_cast<int>(p_.sites.size());
  const int S = static_cast<int>(plan_.stages.size());
  const int M = plan_.micro_batches;
  if (S == 0) return absl::InvalidArgumentError("plan: no stages");
  if (M < 1) return absl::InvalidArgumentError("plan: micro_batches must be at least 1");
  std::map<std::string, int> index;
  for (int s = 0; s < n; ++s) index[p_.sites[s].name] = s;
  bw_.assign(n, std::vector<double>(n, 0.0));
  lat_.assign(n, std::vector<double>(n, 0.0));
  receive_.assign(n, std::vector<double>(n, 0.0));
  for (const auto& l : p_.links) {
    bw_[index.at(l.from)][index.at(l.to)] = l.bandwidth_bytes_per_second;
    lat_[index.at(l.from)][index.at(l.to)] = l.latency_seconds;
    receive_[index.at(l.from)][index.at(l.to)] = l.receive_seconds_per_byte;
  }
  uplink_.resize(n);
  for (int s = 0; s < n; ++s) uplink_[s] = p_.sites[s].uplink_bytes_per_second;
  link_free_.assign(n, std::vector<double>(n, 0.0));
  uplink_free_.assign(n, 0.0);
  if (static_cast<int>(plan_.links.size()) != S - 1)
    return absl::InvalidArgumentError(
        absl::StrCat("plan: ", S, " stages need ", S - 1, " links, not ", plan_.links.size()));
  stage_workers_.resize(S);
  owners_.resize(S);
  whole_pipelines_ = plan_.sync.diloco && partitioner::WholePipelineReplicas(plan_.stages);
  for (int k = 0; k < S; ++k) {
    const auto& st = plan_.stages[k];
    const std::string where = absl::StrCat("plan: stage ", k + 1);
    if (st.sites.empty()) return absl::InvalidArgumentError(where + ": no sites");
    if (st.first_op < 0 || st.last_op < st.first_op || st.last_op >= static_cast<int>(g_.ops.size()))
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ops ", st.first_op, "..", st.last_op, " not in the graph"));
    if (st.micro_batches.size() != st.sites.size() ||
        std::accumulate(st.micro_batches.begin(), st.micro_batches.end(), 0) != M)
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": micro-batch shares must be one per site, summing to ", M));
    owners_[k] = partitioner::MicroBatchOwners(st.micro_batches);
    const double share = partitioner::ForwardShare(g_, st.first_op, st.last_op);
    for (size_t r = 0; r < st.sites.size(); ++r) {
      const int site = st.sites[r];
      if (site < 0 || site >= n)
        return absl::InvalidArgumentError(absl::StrCat(where, ": site index ", site, " unknown"));
      Worker w;
      w.site = site;
      w.stage = k;
      w.replica = static_cast<int>(r);
      const double t = partitioner::RangeSeconds(g_, p_.sites[site], st.first_op, st.last_op);
      w.forward = t * share;
      w.backward = t * (1 - share);
      w.recompute = t * (partitioner::ComputeFactor(g_, st.first_op, st.last_op, st.recompute) - 1);
      w.optimizer = partitioner::OptimizerSeconds(g_, p_.sites[site], st.first_op, st.last_op, plan_.zero);
      w.in_flight = st.in_flight;
      w.micro_batches = st.micro_batches[r];
      stage_workers_[k].push_back(static_cast<int>(workers_.size()));
      workers_.push_back(std::move(w));
    }
    grad_bytes_.push_back(partitioner::GradientBytes(g_, st.first_op, st.last_op, o_.gradient_bytes_fraction));
    const std::string gc = st.gradient_codec.empty() ? "identity" : st.gradient_codec;
    if (st.sites.size() > 1 && !plan_.sync.diloco && !partitioner::PriceCodec(gc).ok())
      return absl::InvalidArgumentError(absl::StrCat(where, ": gradient codec '", gc, "' is not a codec"));
    grad_codec_.push_back(CodecOf(gc, partitioner::PriceCodec(gc).ok() ? partitioner::PriceCodec(gc)->ratio : 1.0));
    int buckets = std::max(1, static_cast<int>(std::ceil(grad_bytes_.back() / std::max<int64_t>(1, o_.bucket_bytes))));
    const double R = static_cast<double>(st.sites.size());
    if (R > 1 && buckets * 2 * R * (R - 1) > kMaxTransfersPerSum) {
      buckets = std::max(1, static_cast<int>(kMaxTransfersPerSum / (2 * R * (R - 1))));
      coarse_ = true;
    }
    buckets_.push_back(buckets);
    // Every pair of sites that exchange something needs a link both ways.
    for (int a : st.sites)
      for (int b : st.sites)
        if (a != b && st.sites.size() > 1 && bw_[a][b] <= 0)
          return absl::InvalidArgumentError(absl::StrCat(where, ": replicas '", p_.sites[a].name, "' and '",
                                                         p_.sites[b].name, "' have no link in the profile"));
  }
  for (int k = 0; k + 1 < S; ++k) {
    const auto& l = plan_.links[k];
    links_.push_back(CodecOf(l.codec, l.ratio));
    link_bytes_.push_back(l.bytes);
    for (int a : plan_.stages[k].sites)
      for (int b : plan_.stages[k + 1].sites)
        if (bw_[a][b] <= 0 || bw_[b][a] <= 0)
          return absl::InvalidArgumentError(absl::StrCat("plan: link ", k + 1, ": sites '", p_.sites[a].name, "' and '",
                                                         p_.sites[b].name, "' have no link in the profile"));
  }
  return absl::OkStatus();
}

void Simulation::Transfer(int a, int b, double bytes, double t, Activity activity, std::function<void(double)> arrived,
                          std::function<void(double)> left) {
  At(t, [=, this, arrived = std::move(arrived), left = std::move(left), activity = std::move(activity)]() mutable {
    double start = std::max(t, link_free_[a][b]);
    double rate = bw_[a][b];
    if (uplink_[a] > 0) {
      start = std::max(start, uplink_free_[a]);
      rate = std::min(rate, uplink_[a]);
    }
    const double end = start + bytes / rate;
    link_free_[a][b] = end;
    if (uplink_[a] > 0) uplink_free_[a] = end;
    activity.start = start;
    activity.end = end;
    if (activity.step >= keep_from_) records_.push_back({activity, a, b, bytes});
    if (left) At(end, [left = std::move(left), end] { left(end); });
    At(end + lat_[a][b], [arrived = std::move(arrived), when = end + lat_[a][b]] { arrived(when); });
  });
}

void Simulation::ChunkedTransfer(int a, int b, double bytes, double chunk, double t, Activity activity,
                                 std::function<void(double)> arrived) {
  if (bytes <= chunk) return Transfer(a, b, bytes, t, std::move(activity), std::move(arrived));
  // The first chunk now; the rest when it has left the link.
  Transfer(
      a, b, chunk, t, activity, [](double) {},
      [=, this, arrived = std::move(arrived)](double when) mutable {
        ChunkedTransfer(a, b, bytes - chunk, chunk, when, activity, std::move(arrived));
      });
}

void Simulation::StartStep(int wi, double t) {
  Worker& w = workers_[wi];
  w.step += 1;
  if (w.step >= steps_) return;
  // Its passes: with job.step_overlap the next step's first micro-batches begin in this one, none after a
  // DiLoCo synchronisation point (partitioner::EarlyMicroBatches; the job's checkpoint steps are not in the
  // plan).
  const int sync_period =
      plan_.sync.diloco ? partitioner::DilocoSyncPeriod(plan_.sync.inner_steps, plan_.sync.fragments) : 0;
  auto early = [&](int s) { return partitioner::EarlyMicroBatches(plan_.step_overlap, s, steps_, 0, sync_period); };
  const int S = static_cast<int>(plan_.stages.size());
  w.order.clear();
  for (auto e : partitioner::OverlappedStepSchedule(w.stage, S, plan_.micro_batches, w.in_flight, early(w.step),
                                                    early(w.step + 1)))
    if (owners_[w.stage][e.micro_batch] == w.replica) w.order.push_back(e);
  w.last_backward = -1;
  for (int i = 0; i < static_cast<int>(w.order.size()); ++i)
    if (w.order[i].kind == 'B' && !w.order[i].next) w.last_backward = i;
  w.norm_at = w.last_backward >= 0 ? static_cast<size_t>(w.last_backward + 1) : w.order.size();
  w.next = 0;
  w.phase = 0;
  w.sent_up = false;
  w.sent_down = false;
  w.buckets_done = 0;
  w.step_start = t;
  if (w.step == reported_steps_ - 1) last_step_start_ = std::min(last_step_start_, t);
  TryRun(wi, t);
}

void Simulation::TryRun(int wi, double now) {
  Worker& w = workers_[wi];
  if (w.busy || (w.phase != 0 && w.phase != 4) || w.step >= steps_) return;
  const int S = static_cast<int>(plan_.stages.size());
  if (w.next >= w.order.size()) {
    if (w.phase == 0) return AfterPasses(wi, now);
    w.phase = 5;  // the next step's early passes done: the norm's second half
    return Advance(wi, now);
  }
  const auto [kind, m, next] = w.order[w.next];
  const int of = w.step + (next ? 1 : 0);                 // the micro-batch's step
  if (kind == 'B' && w.recompute > 0 && !w.recomputed) {  // needs no gradient: at once
    w.busy = true;
    At(now + w.recompute, [this, wi, now, end = now + w.recompute] { RecomputeDone(wi, now, end); });
    return;
  }
  // The pass's codec work, and its transport work (each frame it receives or sends) on a CPU site.
  double codec = 0, transport = 0;
  const partitioner::SiteProfile& site = p_.sites[w.site];
  if (kind == 'F') {
    if (w.stage > 0) {
      auto it = w.activations.find({of, m});
      if (it == w.activations.end()) return;
      w.activations.erase(it);
      codec += CodecSeconds(w.site, links_[w.stage - 1].name, link_bytes_[w.stage - 1]);
      transport += partitioner::TransportSeconds(site, link_bytes_[w.stage - 1] * links_[w.stage - 1].forward_ratio,
                                                 receive_[workers_[WorkerOf(w.stage - 1, m)].site][w.site]);
    }
    if (w.stage + 1 < S) {
      codec += CodecSeconds(w.site, links_[w.stage].name, link_bytes_[w.stage]);
      transport += partitioner::TransportSeconds(site, link_bytes_[w.stage] * links_[w.stage].forward_ratio);
    }
  } else {
    if (w.stage + 1 < S) {
      auto it = w.gradients.find({of, m});
      if (it == w.gradients.end()) return;
      w.gradients.erase(it);
      codec += CodecSeconds(w.site, compression::GradientCodecBehind(links_[w.stage].name), link_bytes_[w.stage]);
      transport += partitioner::TransportSeconds(site, link_bytes_[w.stage] * links_[w.stage].backward_ratio,
                                                 receive_[workers_[WorkerOf(w.stage + 1, m)].site][w.site]);
    }
    if (w.stage > 0) {
      codec +=
          CodecSeconds(w.site, compression::GradientCodecBehind(links_[w.stage - 1].name), link_bytes_[w.stage - 1]);
      transport += partitioner::TransportSeconds(site, link_bytes_[w.stage - 1] * links_[w.stage - 1].backward_ratio);
    }
  }
  const double start = now;
  const double end = start + (kind == 'F' ? w.forward : w.backward) + codec + transport;
  w.busy = true;
  // Replica sums: the last backward pass hands over its buckets as it goes.
  const int R = static_cast<int>(stage_workers_[w.stage].size());
  if (kind == 'B' && static_cast<int>(w.next) == w.last_backward && R > 1 && !plan_.sync.diloco) {
    const int nb = buckets_[w.stage];
    for (int b = 0; b < nb; ++b)
      At(start + (end - start) * (b + 1) / nb,
         [this, stage = w.stage, step = w.step, b, r = w.replica, t = start + (end - start) * (b + 1) / nb] {
           BucketReady(stage, step, b, r, t);
         });
  }
  At(end, [this, wi, start, end, codec] { PassDone(wi, start, end, codec); });
}

void Simulation::RecomputeDone(int wi, double start, double end) {
  Worker& w = workers_[wi];
  w.busy = false;
  w.recomputed = true;
  w.compute[w.step] += end - start;
  if (w.step >= keep_from_)
    records_.push_back({{p_.sites[w.site].name, "recompute", w.step + (w.order[w.next].next ? 1 : 0),
                         w.order[w.next].micro_batch, "", start, end}});
  TryRun(wi, end);
}

void Simulation::PassDone(int wi, double start, double end, double codec) {
  Worker& w = workers_[wi];
  const int S = static_cast<int>(plan_.stages.size());
  const auto [kind, m, next] = w.order[w.next];
  const int of = w.step + (next ? 1 : 0);  // the micro-batch's step
  w.busy = false;
  w.recomputed = false;
  w.compute[w.step] += end - start;
  w.codec[w.step] += codec;
  if (w.step >= keep_from_)
    records_.push_back({{p_.sites[w.site].name, kind == 'F' ? "forward" : "backward", of, m, "", start, end}});
  if (kind == 'F' && w.stage + 1 < S) {
    const int to = WorkerOf(w.stage + 1, m);
    const double bytes = link_bytes_[w.stage] * links_[w.stage].forward_ratio;
    Transfer(w.site, workers_[to].site, bytes, end,
             {p_.sites[w.site].name, "send", of, m, p_.sites[workers_[to].site].name}, [this, to, of, m](double t) {
               workers_[to].activations[{of, m}] = t;
               TryRun(to, t);
             });
  } else if (kind == 'B' && w.stage > 0) {
    const int to = WorkerOf(w.stage - 1, m);
    const double bytes = link_bytes_[w.stage - 1] * links_[w.stage - 1].backward_ratio;
    Transfer(w.site, workers_[to].site, bytes, end,
             {p_.sites[w.site].name, "send", of, m, p_.sites[workers_[to].site].name}, [this, to, of, m](double t) {
               workers_[to].gradients[{of, m}] = t;
               TryRun(to, t);
             });
  }
  ++w.next;
  // The step's last backward pass: its sums and the norm's first half come before the next step's early
  // passes (job.step_overlap); without them TryRun gets there once every pass has run.
  if (w.phase == 0 && w.next == w.norm_at && w.norm_at < w.order.size()) return AfterPasses(wi, end);
  TryRun(wi, end);
}

void Simulation::AfterPasses(int wi, double t) {
  Worker& w = workers_[wi];
  const int R = static_cast<int>(stage_workers_[w.stage].size());
  w.phase = R > 1 && !plan_.sync.diloco ? 1 : 2;
  // The sum's codec and transport work shares the site's CPU with the passes (executor/replica_sync.h: the
  // averager's threads, then the compute thread's decoding of the sums): on a CPU site it ends at the
  // earliest that long after the passes, however early the links deliver.
  if (w.phase == 1) {
    double receive = 0;  // the costliest link from another replica
    for (int other : stage_workers_[w.stage]) receive = std::max(receive, receive_[workers_[other].site][w.site]);
    w.sum_cpu_until = t + partitioner::ReplicaSumCpuSeconds(p_.sites[w.site], grad_codec_[w.stage].name,
                                                            grad_codec_[w.stage].forward_ratio, grad_bytes_[w.stage], R,
                                                            buckets_[w.stage], receive);
    if (w.sum_cpu_until > t) At(w.sum_cpu_until, [this, wi, until = w.sum_cpu_until] { Advance(wi, until); });
  }
  if (w.phase == 1 && w.last_backward < 0) {
    // A replica without micro-batches this step hands over zero gradients at once.
    for (int b = 0; b < buckets_[w.stage]; ++b) BucketReady(w.stage, w.step, b, w.replica, t);
  }
  Advance(wi, t);
}

void Simulation::Contribute(const ReductionKey& key, int replica, double t) {
  Reduction& red = reductions_.at(key);
  const int stage = std::get<0>(key), step = std::get<1>(key);
  const auto& ws = stage_workers_[stage];
  const int R = static_cast<int>(ws.size());
  red.contributed[replica] = true;
  const int from = workers_[ws[replica]].site;
  for (int j = 0; j < R; ++j) {
    if (j == replica) continue;
    const int to = workers_[ws[j]].site;
    auto arrived = [this, key, j](double when) {
      ++reductions_.at(key).scattered[j];
      MaybeGather(key, j, when);
    };
    Activity a{p_.sites[from].name, red.kind, step, -1, p_.sites[to].name};
    if (red.chunk_bytes > 0)
      ChunkedTransfer(from, to, red.part_bytes, red.chunk_bytes, t, a, arrived);
    else
      Transfer(from, to, red.part_bytes, t, a, arrived);
  }
  MaybeGather(key, replica, t);
}

void Simulation::MaybeGather(const ReductionKey& key, int j, double t) {
  Reduction& red = reductions_.at(key);
  const int stage = std::get<0>(key), step = std::get<1>(key);
  const auto& ws = stage_workers_[stage];
  const int R = static_cast<int>(ws.size());
  if (!red.contributed[j] || red.scattered[j] != R - 1) return;
  red.scattered[j] = -1;                      // gathered once
  if (red.all_gather) return red.done(j, t);  // j holds every replica's contribution
  const int from = workers_[ws[j]].site;
  for (int u = 0; u < R; ++u) {
    if (u == j) continue;
    const int to = workers_[ws[u]].site;
    auto arrived = [this, key, u, R](double when) {
      Reduction& r = reductions_.at(key);
      if (++r.gathered[u] == R - 1) r.done(u, when);
    };
    Activity a{p_.sites[from].name, red.kind, step, -1, p_.sites[to].name};
    if (red.chunk_bytes > 0)
      ChunkedTransfer(from, to, red.part_bytes, red.chunk_bytes, t, a, arrived);
    else
      Transfer(from, to, red.part_bytes, t, a, arrived);
  }
  if (R == 1) red.done(j, t);
}

void Simulation::BucketReady(int stage, int step, int bucket, int replica, double t) {
  const ReductionKey key{stage, step, bucket};
  auto [it, inserted] = reductions_.try_emplace(key);
  if (inserted) {
    const int R = static_cast<int>(stage_workers_[stage].size());
    Reduction& red = it->second;
    red.kind = "sync";
    red.part_bytes = grad_bytes_[stage] / buckets_[stage] / R * grad_codec_[stage].forward_ratio;
    red.contributed.assign(R, false);
    red.scattered.assign(R, 0);
    red.gathered.assign(R, 0);
    red.done = [this, stage, step](int u, double when) {
      const int wi = stage_workers_[stage][u];
      ++workers_[wi].buckets_done;
      if (workers_[wi].step == step) Advance(wi, when);
    };
  }
  Contribute(key, replica, t);
}

void Simulation::SendControl(int from, int to, double t) {
  const Worker& f = workers_[from];
  const int a = f.site, b = workers_[to].site;
  Transfer(a, b, kControlBytes, t, {p_.sites[a].name, "control", f.step, -1, p_.sites[b].name},
           [this, from, to, step = f.step](double arrival) {
             workers_[to].control[{step, from}] = arrival;
             if (workers_[to].step == step) Advance(to, arrival);
           });
}

// The executor's end of a step (executor/stage.cc): the gradient sum, then the norm and loss messages.
void Simulation::Advance(int wi, double t) {
  Worker& w = workers_[wi];
  if (w.step >= steps_) return;
  const int S = static_cast<int>(plan_.stages.size());
  const auto& R = stage_workers_[w.stage];
  const bool first = w.stage == 0, last = w.stage == S - 1;
  if (w.phase == 1) {
    if (w.buckets_done < buckets_[w.stage] || w.next < w.norm_at) return;
    if (t < w.sum_cpu_until) return;  // AfterPasses scheduled this Advance at sum_cpu_until
    w.phase = 2;
  }
  auto has = [&](int from) { return w.control.count({w.step, from}) > 0; };
  // The norm's first half (executor/stage.cc, after the step's last backward pass): the partial sums up
  // the pipeline, and the first stage's total down it.
  if (w.phase == 2) {
    if (plan_.sync.diloco && S == 1) {
      // Independent DiLoCo workers of the whole model: the others send replica 0 their losses and wait for
      // nothing; no one waits for a norm.
      if (w.replica != 0 && !w.sent_up) {
        w.sent_up = true;
        SendControl(wi, R[0], t);
      }
    } else if (whole_pipelines_) {
      // Pipeline r alone: its partial norms from its last stage to its first and the total back; its stage 0
      // sends its loss share to replica 0.
      const int r = w.replica;
      if (!last && !has(stage_workers_[w.stage + 1][r])) return;
      if (!first && !w.sent_up) {
        w.sent_up = true;
        SendControl(wi, stage_workers_[w.stage - 1][r], t);
      }
      if (first && !w.sent_down) {
        w.sent_down = true;
        if (!last) SendControl(wi, stage_workers_[w.stage + 1][r], t);
        if (r != 0) SendControl(wi, R[0], t);
      }
    } else if (w.replica == 0) {
      if (last)
        for (size_t j = 1; j < R.size(); ++j)
          if (!has(R[j])) return;
      if (!last && !has(stage_workers_[w.stage + 1][0])) return;
      if (!first && !w.sent_up) {
        w.sent_up = true;
        SendControl(wi, stage_workers_[w.stage - 1][0], t);
      }
      if (first && !w.sent_down) {
        w.sent_down = true;
        if (!last)
          for (int nx : stage_workers_[w.stage + 1]) SendControl(wi, nx, t);
        for (size_t j = 1; j < R.size(); ++j) SendControl(wi, R[j], t);
      }
    } else if (last && !w.sent_up) {
      w.sent_up = true;
      SendControl(wi, R[0], t);
    }
    // Then the next step's early passes (job.step_overlap), if this step's part has them.
    if (w.next < w.order.size()) {
      w.phase = 4;
      return TryRun(wi, t);
    }
    w.phase = 5;
  }
  if (w.phase != 5) return;
  // The second half: the total from the previous stage, on to the next; replica 0 of a DiLoCo stage 0 awaits
  // the other workers' loss shares (the executor: after its optimizer step, which is not simulated there).
  if (plan_.sync.diloco && S == 1) {
    if (w.replica == 0)
      for (size_t j = 1; j < R.size(); ++j)
        if (!has(R[j])) return;
  } else if (whole_pipelines_) {
    const int r = w.replica;
    if (!first) {
      if (!has(stage_workers_[w.stage - 1][r])) return;
      if (!w.sent_down) {
        w.sent_down = true;
        if (!last) SendControl(wi, stage_workers_[w.stage + 1][r], t);
      }
    }
    if (first && r == 0)
      for (size_t j = 1; j < R.size(); ++j)
        if (!has(R[j])) return;
  } else if (w.replica == 0) {
    if (!first) {
      if (!has(stage_workers_[w.stage - 1][0])) return;
      if (!w.sent_down) {
        w.sent_down = true;
        if (!last)
          for (int nx : stage_workers_[w.stage + 1]) SendControl(wi, nx, t);
      }
    }
  } else {
    if (!has(first ? R[0] : stage_workers_[w.stage - 1][0])) return;
  }
  w.phase = 3;
  if (w.optimizer <= 0) return StepDone(wi, t);
  // Clipping and the optimizer step, on the compute thread (the executor: then DiLoCo's outer sync).
  w.compute[w.step] += w.optimizer;
  if (w.step >= keep_from_)
    records_.push_back({{p_.sites[w.site].name, "optimizer", w.step, -1, "", t, t + w.optimizer}});
  At(t + w.optimizer, [this, wi, end = t + w.optimizer] { StepDone(wi, end); });
}

void Simulation::ExchangeBegin(int wi, double t) {
  Worker& w = workers_[wi];
  const int R = static_cast<int>(stage_workers_[w.stage].size());
  const int F = std::max(1, plan_.sync.fragments);
  const int fragment = partitioner::FragmentDueAfter(w.step, plan_.sync.inner_steps, plan_.sync.fragments);
  const ReductionKey key{w.stage, w.step, -1 - fragment};
  auto [it, inserted] = reductions_.try_emplace(key);
  if (inserted) {
    Reduction& red = it->second;
    red.kind = "outer_sync";
    red.all_gather = plan_.sync.sparse_sum;
    red.part_bytes = grad_bytes_[w.stage] / F / (red.all_gather ? 1 : R) * plan_.sync.codec.ratio;
    red.chunk_bytes = std::max<double>(1, static_cast<double>(o_.chunk_bytes));
    if (std::ceil(red.part_bytes / red.chunk_bytes) * 2 * R * (R - 1) > kMaxTransfersPerSum) {
      red.chunk_bytes = red.part_bytes * 2 * R * (R - 1) / kMaxTransfersPerSum;
      coarse_ = true;
    }
    red.contributed.assign(R, false);
    red.scattered.assign(R, 0);
    red.gathered.assign(R, 0);
    red.done = [this, stage = w.stage](int u, double when) {
      Worker& x = workers_[stage_workers_[stage][u]];
      x.exchange_open = false;
      if (x.resume) {
        auto resume = std::move(x.resume);
        x.resume = nullptr;
        resume(when);
      }
    };
  }
  w.exchange_open = true;
  Contribute(key, w.replica, t);
}

void Simulation::FinishStep(int wi, double began_waiting, double t) {
  Worker& w = workers_[wi];
  if (t > began_waiting && w.step >= keep_from_)
    records_.push_back({{p_.sites[w.site].name, "wait", w.step, -1, "", began_waiting, t}});
  w.duration[w.step] = t - w.step_start;
  step_end_[w.step] = std::max(step_end_[w.step], t);
  StartStep(wi, t);
}

void Simulation::StepDone(int wi, double t) {
  Worker& w = workers_[wi];
  for (auto it = w.control.begin(); it != w.control.end();)
    it = it->first.first <= w.step ? w.control.erase(it) : std::next(it);
  const int R = static_cast<int>(stage_workers_[w.stage].size());
  if (!plan_.sync.diloco || R < 2 ||
      partitioner::FragmentDueAfter(w.step, plan_.sync.inner_steps, plan_.sync.fragments) < 0)
    return FinishStep(wi, t, t);
  // DiLoCo's synchronisation point (executor/diloco.cc): with overlap, complete the exchange begun a
  // period ago, then begin this one; without, begin it and wait for it.
  auto begin = [this, wi, t](double now) {
    ExchangeBegin(wi, now);
    Worker& x = workers_[wi];
    if (!plan_.sync.overlap && x.exchange_open) {
      x.resume = [this, wi, t](double done) { FinishStep(wi, t, done); };
      return;
    }
    FinishStep(wi, t, now);
  };
  if (plan_.sync.overlap && w.exchange_open) {
    w.resume = begin;
    return;
  }
  begin(t);
}

void Simulation::Run(int steps, int extra) {
  steps_ = steps + extra;
  reported_steps_ = steps;
  // The last step, and under DiLoCo the period before it (an exchange begun then may run during it).
  const int lookback =
      plan_.sync.diloco ? partitioner::DilocoSyncPeriod(plan_.sync.inner_steps, plan_.sync.fragments) + 1 : 1;
  keep_from_ = std::max(0, steps - 1 - lookback);
  last_step_start_ = std::numeric_limits<double>::infinity();
  step_end_.assign(steps_, 0.0);
  for (int wi = 0; wi < static_cast<int>(workers_.size()); ++wi) StartStep(wi, 0.0);
  while (!events_.empty()) {
    Event e = events_.top();
    events_.pop();
    e.fn();
  }
}

std::string Simulation::Stuck() const {
  for (const Worker& w : workers_)
    if (w.step < steps_)
      return absl::StrCat("stage ", w.stage + 1, " at site '", p_.sites[w.site].name, "' in step ", w.step + 1);
  return "";
}

SimulationResult Simulation::Result(int steps) {
  SimulationResult r;
  double prev = 0;
  for (int s = 0; s < steps; ++s) {
    r.step_times.push_back(step_end_[s] - prev);
    prev = step_end_[s];
  }
  std::vector<double> later(r.step_times.begin() + (steps > 1 ? 1 : 0), r.step_times.end());
  r.step_seconds = std::accumulate(later.begin(), later.end(), 0.0) / later.size();
  std::vector<double> sorted = later;
  std::sort(sorted.begin(), sorted.end());
  r.median_step_seconds =
      sorted.size() % 2 ? sorted[sorted.size() / 2] : (sorted[sorted.size() / 2 - 1] + sorted[sorted.size() / 2]) / 2;
  const int last = steps - 1;
  // The last step's window: from the first site starting it to the last one finishing it.
  const double t0 = last_step_start_, t1 = step_end_[last];
  r.last_step_seconds = t1 - t0;
  r.compute_bound_seconds = partitioner::ComputeBoundSeconds(g_, p_, plan_.micro_batches);
  r.utilisation = r.step_seconds > 0 ? r.compute_bound_seconds / r.step_seconds : 0;
  // Transfers and passes as far as they fall in the window.
  std::map<std::pair<int, int>, std::pair<double, double>> link_use;  // bytes, seconds
  std::map<int, double> sent;                                         // site -> seconds its links were busy
  for (const Record& rec : records_) {
    if (rec.activity.end <= t0 || rec.activity.start >= t1) continue;  // outside the window (or at its edge)
    const double a = std::max(rec.activity.start, t0), b = std::min(rec.activity.end, t1);
    Activity x = rec.activity;
    x.start = a - t0;
    x.end = b - t0;
    r.timeline.push_back(x);
    if (rec.from < 0) continue;
    const double d = rec.activity.end - rec.activity.start;
    auto& use = link_use[{rec.from, rec.to}];
    use.first += d > 0 ? rec.bytes * (b - a) / d : rec.bytes;
    use.second += b - a;
    sent[rec.from] += b - a;
  }
  double busy = 0;
  for (const Worker& w : workers_) {
    SiteReport s;
    s.site = p_.sites[w.site].name;
    s.stage = w.stage;
    s.replica = w.replica;
    s.micro_batches = w.micro_batches;
    auto get = [&](const std::map<int, double>& m) {
      auto it = m.find(last);
      return it == m.end() ? 0.0 : it->second;
    };
    s.compute_seconds = get(w.compute);
    s.codec_seconds = get(w.codec);
    s.send_seconds = sent.count(w.site) ? sent[w.site] : 0.0;
    s.wait_seconds = std::max(0.0, get(w.duration) - s.compute_seconds);
    busy += s.compute_seconds;
    r.sites.push_back(s);
  }
  r.bubble_fraction = r.last_step_seconds > 0 ? std::max(0.0, 1 - busy / (workers_.size() * r.last_step_seconds)) : 0.0;
  for (const auto& [ab, use] : link_use) {
    LinkReport l;
    l.from = p_.sites[ab.first].name;
    l.to = p_.sites[ab.second].name;
    l.bytes = use.first;
    l.busy_fraction = r.last_step_seconds > 0 ? use.second / r.last_step_seconds : 0;
    r.links.push_back(l);
  }
  std::sort(r.timeline.begin(), r.timeline.end(),
            [](const Activity& a, const Activity& b) { return a.start < b.start; });
  std::set<std::string> priced;
  for (const auto& l : links_)
    for (int s = 0; s < static_cast<int>(p_.sites.size()); ++s)
      if (CodecSeconds(s, l.name, 1) > 0) priced.insert(l.name);
  for (const auto& l : links_)
    if (l.name != "identity" && !priced.count(l.name))
      r.notes.push_back(absl::StrCat(
          "codec '", l.name, "' has no codec_bytes_per_second in the profile: its encoding costs nothing here"));
  r.notes.push_back("the optimizer step and data loading are not in the profile and not simulated");
  if (coarse_)
    r.notes.push_back("replica sums over many replicas: buckets or chunks merged to keep the simulation short");
  if (plan_.sync.diloco)
    r.notes.push_back(absl::StrFormat("DiLoCo: H = %d, %d fragment(s), %s, codec %s", plan_.sync.inner_steps,
                                      plan_.sync.fragments, plan_.sync.overlap ? "overlapped" : "not overlapped",
                                      plan_.sync.codec.name));
  return r;
}

// The planner's formula for `plan`'s layout: a fixed pipeline with its replicas and sync, the link codecs
// chosen by the planner's adaptive rule from the plan's own codecs (so a plan with one codec keeps it).
absl::StatusOr<double> AnalyticStepSeconds(const OpGraph& graph, const ClusterProfile& profile, const Plan& plan,
                                           const SimulationOptions& options) {
  partitioner::PlanOptions o;
  o.micro_batches = plan.micro_batches;
  o.sync = plan.sync;
  o.replication = false;
  o.deep_pipeline = false;
  o.gradient_bytes_fraction = options.gradient_bytes_fraction;
  std::vector<std::vector<int>> sites, shares;  // the plan's shares: they decide which site pairs a link uses
  std::vector<int> last_ops;
  for (const auto& st : plan.stages)
    sites.push_back(st.sites), last_ops.push_back(st.last_op), shares.push_back(st.micro_batches);
  partitioner::PinLayout(sites, last_ops, &o, shares);
  std::vector<partitioner::Codec> menu;
  for (const auto& l : plan.links) {
    partitioner::Codec c{l.codec, l.ratio};
    if (auto priced = partitioner::PriceCodec(l.codec); priced.ok()) c = *priced, c.ratio = l.ratio;
    if (std::none_of(menu.begin(), menu.end(), [&](const partitioner::Codec& m) { return m.name == c.name; }))
      menu.push_back(c);
  }
  if (!menu.empty()) {
    std::sort(menu.begin(), menu.end(), [](const auto& a, const auto& b) { return a.ratio > b.ratio; });
    o.link_codecs = menu;
    o.adaptive_compression = true;
  }
  std::vector<partitioner::Codec> gradient;
  for (const auto& st : plan.stages)
    if (st.sites.size() > 1 && !st.gradient_codec.empty())
      if (auto priced = partitioner::PriceCodec(st.gradient_codec); priced.ok()) gradient.push_back(*priced);
  if (!gradient.empty()) {
    o.gradient_codecs = {gradient.front()};
    o.adaptive_compression = true;
  }
  auto evaluated = partitioner::PlanPipeline(graph, profile, o);
  if (!evaluated.ok()) return evaluated.status();
  return evaluated->formula_step_seconds;
}

}  // namespace

absl::StatusOr<SimulationResult> Simulate(const OpGraph& graph, const ClusterProfile& profile, const Plan& plan,
                                          const SimulationOptions& options) {
  Simulation sim(graph, profile, plan, options);
  if (absl::Status s = sim.Init(); !s.ok()) return s;
  int steps = options.steps;
  if (steps <= 0) steps = plan.sync.diloco ? 2 * std::max(1, plan.sync.inner_steps) + 1 : 3;
  sim.Run(steps, plan.step_overlap > 0 ? 1 : 0);  // the last step reported begins the next one's, as a run's do
  auto analytic = AnalyticStepSeconds(graph, profile, plan, options);
  if (std::string stuck = sim.Stuck(); !stuck.empty())
    return absl::FailedPreconditionError(absl::StrCat(
        "the plan's schedules wait on each other (in-flight depths increasing along the pipeline?): ", stuck,
        " never finished"));
  SimulationResult r = sim.Result(steps);
  if (analytic.ok())
    r.analytic_step_seconds = *analytic;
  else
    r.notes.push_back(absl::StrCat("analytic model: ", analytic.status().message()));
  return r;
}

absl::StatusOr<ClusterProfile> CalibrateCompute(const OpGraph& graph, const ClusterProfile& profile, const Plan& plan,
                                                const std::map<std::string, double>& seconds) {
  ClusterProfile out = profile;
  for (const auto& [name, target] : seconds) {
    const partitioner::StagePlan* stage = nullptr;
    int site = -1;
    for (const auto& st : plan.stages)
      for (size_t r = 0; r < st.site_names.size(); ++r)
        if (st.site_names[r] == name) stage = &st, site = st.sites[r];
    if (!stage)
      return absl::InvalidArgumentError(absl::StrCat("calibration: site '", name, "' runs no stage of the plan"));
    if (!(target > 0) || !std::isfinite(target))
      return absl::InvalidArgumentError(absl::StrCat("calibration: site '", name, "': seconds must be positive"));
    auto& sp = out.sites[site];
    // What the site measures includes a recomputing stage's second forward pass.
    const double now = partitioner::StagePassSeconds(graph, sp, *stage);
    if (!(now > 0)) return absl::InvalidArgumentError(absl::StrCat("calibration: site '", name, "' computes nothing"));
    const double factor = target / now;
    for (auto& [op, t] : sp.op_seconds) t *= factor;
    sp.flops_per_second /= factor;
  }
  return out;
}

absl::StatusOr<Plan> ParsePlanJson(const std::string& text, const std::string& path, const OpGraph& graph,
                                   const ClusterProfile& profile) {
  auto bad = [&](const std::string& field, const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", field, ": ", what));
  };
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return bad("top level", "not a JSON object");
  Plan plan;
  if (!j.contains("micro_batches") || !j["micro_batches"].is_number_integer() ||
      j["micro_batches"].get<int64_t>() < 1 || j["micro_batches"].get<int64_t>() > (1 << 20))
    return bad("micro_batches", "expected a positive integer");
  plan.micro_batches = j["micro_batches"].get<int>();
  if (j.contains("zero")) {  // job.optimizer.zero (absent in plan.json before it was written: 0)
    if (!j["zero"].is_number_integer() || j["zero"].get<int64_t>() < 0 || j["zero"].get<int64_t>() > 1)
      return bad("zero", "expected 0 or 1");
    plan.zero = j["zero"].get<int>();
  }
  if (j.contains("step_overlap")) {  // job.step_overlap (absent in plan.json before it was written: 0)
    if (!j["step_overlap"].is_number_integer() || j["step_overlap"].get<int64_t>() < 0 ||
        j["step_overlap"].get<int64_t>() >= plan.micro_batches)
      return bad("step_overlap", "expected an integer from 0 to micro_batches - 1");
    plan.step_overlap = j["step_overlap"].get<int>();
  }
  const int M = plan.micro_batches;
  std::map<std::string, int> index;
  for (int s = 0; s < static_cast<int>(profile.sites.size()); ++s) index[profile.sites[s].name] = s;
  const int ops = static_cast<int>(graph.ops.size());
  if (!j.contains("stages") || !j["stages"].is_array() || j["stages"].empty())
    return bad("stages", "expected a non-empty list");
  std::set<std::string> seen;
  for (size_t k = 0; k < j["stages"].size(); ++k) {
    const json& st = j["stages"][k];
    const std::string where = absl::StrCat("stages[", k, "]");
    if (!st.is_object()) return bad(where, "expected an object");
    partitioner::StagePlan sp;
    if (!st.contains("sites") || !st["sites"].is_array() || st["sites"].empty())
      return bad(where + ".sites", "expected a non-empty list of site names");
    for (const json& site : st["sites"]) {
      if (!site.is_string()) return bad(where + ".sites", "expected site names");
      const std::string name = site.get<std::string>();
      if (!index.count(name)) return bad(where + ".sites", absl::StrCat("site '", name, "' is not in the profile"));
      if (!seen.insert(name).second) return bad(where + ".sites", absl::StrCat("site '", name, "' appears twice"));
      sp.sites.push_back(index[name]);
      sp.site_names.push_back(name);
    }
    sp.first_op = k == 0 ? 0 : plan.stages.back().last_op + 1;
    if (!st.contains("last_op") || !st["last_op"].is_number_integer())
      return bad(where + ".last_op", "expected an op index");
    const int64_t last = st["last_op"].get<int64_t>();
    if (last < sp.first_op || last >= ops)
      return bad(where + ".last_op",
                 absl::StrCat(last, " is not an op after ", sp.first_op - 1, " in a graph of ", ops));
    sp.last_op = static_cast<int>(last);
    if (st.contains("first_op") &&
        (!st["first_op"].is_number_integer() || st["first_op"].get<int64_t>() != sp.first_op))
      return bad(where + ".first_op",
                 absl::StrCat("expected ", sp.first_op, " (the op after the previous stage's last)"));
    if (st.contains("micro_batches")) {
      const json& mb = st["micro_batches"];
      if (!mb.is_array() || mb.size() != sp.sites.size())
        return bad(where + ".micro_batches", "expected one count per site");
      int sum = 0;
      for (const json& c : mb) {
        if (!c.is_number_integer() || c.get<int64_t>() < 0 || c.get<int64_t>() > M)
          return bad(where + ".micro_batches", "expected non-negative counts");
        sp.micro_batches.push_back(c.get<int>());
        sum += sp.micro_batches.back();
      }
      if (sum != M) return bad(where + ".micro_batches", absl::StrCat("the counts sum to ", sum, ", not ", M));
    } else if (sp.sites.size() == 1) {
      sp.micro_batches = {M};
    } else {
      return bad(where + ".micro_batches", "missing (needed for replicas)");
    }
    if (st.contains("in_flight")) {
      if (!st["in_flight"].is_number_integer() || st["in_flight"].get<int64_t>() < 0 ||
          st["in_flight"].get<int64_t>() > M)
        return bad(where + ".in_flight", absl::StrCat("expected an integer from 0 (1F1B) to ", M));
      sp.in_flight = st["in_flight"].get<int>();
    }
    if (st.contains("recompute")) {
      if (!st["recompute"].is_boolean()) return bad(where + ".recompute", "expected true or false");
      sp.recompute = st["recompute"].get<bool>();
    }
    if (st.contains("gradient_codec")) {
      if (!st["gradient_codec"].is_string() || !partitioner::PriceCodec(st["gradient_codec"].get<std::string>()).ok())
        return bad(where + ".gradient_codec", "expected a codec name (compression/)");
      sp.gradient_codec = st["gradient_codec"].get<std::string>();
    }
    plan.stages.push_back(std::move(sp));
  }
  if (plan.stages.back().last_op != ops - 1)
    return bad("stages", absl::StrCat("the last stage ends at op ", plan.stages.back().last_op,
                                      ", not the graph's last (", ops - 1, ")"));
  const std::vector<double> cut_bytes = partitioner::CutBytes(graph);
  const int S = static_cast<int>(plan.stages.size());
  const json links = j.contains("links") ? j["links"] : json::array();
  if (!links.is_array() || static_cast<int>(links.size()) != S - 1)
    return bad("links", absl::StrCat("expected ", S - 1, " links (one between each two stages)"));
  for (int k = 0; k + 1 < S; ++k) {
    const json& l = links[k];
    const std::string where = absl::StrCat("links[", k, "]");
    partitioner::LinkPlan lp;
    lp.from_stage = k;
    lp.bytes = cut_bytes[plan.stages[k].last_op];
    if (!l.is_object()) return bad(where, "expected an object");
    lp.codec = "identity";
    if (l.contains("codec")) {
      if (!l["codec"].is_string()) return bad(where + ".codec", "expected a codec name");
      lp.codec = l["codec"].get<std::string>();
    }
    auto priced = partitioner::PriceCodec(lp.codec);
    if (l.contains("ratio")) {
      if (!l["ratio"].is_number() || !(l["ratio"].get<double>() > 0) || l["ratio"].get<double>() > 1)
        return bad(where + ".ratio", "expected a number in (0, 1]");
      lp.ratio = l["ratio"].get<double>();
    } else if (priced.ok()) {
      lp.ratio = priced->ratio;
    } else {
      return bad(where + ".codec", absl::StrCat("'", lp.codec, "' is not a codec, and no ratio is given"));
    }
    plan.links.push_back(lp);
  }
  if (j.contains("sync")) {
    const json& s = j["sync"];
    if (!s.is_object() || !s.contains("mode") || !s["mode"].is_string())
      return bad("sync.mode", "expected every_step or diloco");
    const std::string mode = s["mode"].get<std::string>();
    if (mode == "diloco") {
      plan.sync.diloco = true;
      auto integer = [&](const char* key, int* out) -> absl::Status {
        if (!s.contains(key)) return absl::OkStatus();
        if (!s[key].is_number_integer() || s[key].get<int64_t>() < 1 || s[key].get<int64_t>() > 10000)
          return bad(absl::StrCat("sync.", key), "expected a positive integer");
        *out = s[key].get<int>();
        return absl::OkStatus();
      };
      if (auto st = integer("inner_steps", &plan.sync.inner_steps); !st.ok()) return st;
      if (auto st = integer("fragments", &plan.sync.fragments); !st.ok()) return st;
      if (s.contains("overlap")) {
        if (!s["overlap"].is_boolean()) return bad("sync.overlap", "expected true or false");
        plan.sync.overlap = s["overlap"].get<bool>();
      }
      if (s.contains("codec")) {
        auto c = s["codec"].is_string() ? partitioner::PriceCodec(s["codec"].get<std::string>())
                                        : absl::InvalidArgumentError("");
        if (!c.ok()) return bad("sync.codec", "expected a codec name (compression/)");
        plan.sync.codec = *c;
      }
      if (s.contains("ratio")) {
        if (!s["ratio"].is_number() || !(s["ratio"].get<double>() > 0) || s["ratio"].get<double>() > 1)
          return bad("sync.ratio", "expected a number in (0, 1]");
        plan.sync.codec.ratio = s["ratio"].get<double>();
      }
      if (s.contains("sparse_sum")) {
        if (!s["sparse_sum"].is_boolean()) return bad("sync.sparse_sum", "expected true or false");
        if (s["sparse_sum"].get<bool>())
          if (absl::Status st = plan.sync.UseSparseSum(); !st.ok())
            return bad("sync.sparse_sum", std::string(st.message()));
      }
      if (plan.sync.fragments > plan.sync.inner_steps) return bad("sync.fragments", "more than inner_steps");
    } else if (mode != "every_step") {
      return bad("sync.mode", absl::StrCat("'", mode, "': expected every_step or diloco"));
    }
  }
  if (j.contains("predicted_step_seconds") && j["predicted_step_seconds"].is_number())
    plan.predicted_step_seconds = j["predicted_step_seconds"].get<double>();
  return plan;
}

std::string SimulationJson(const SimulationResult& r) {
  json links = json::array(), stages = json::array();
  for (const auto& l : r.links)
    links.push_back({{"from", l.from}, {"to", l.to}, {"bytes", l.bytes}, {"busy_fraction", l.busy_fraction}});
  for (const auto& s : r.sites) {
    if (static_cast<int>(stages.size()) <= s.stage) stages.push_back({{"stage", s.stage}, {"sites", json::array()}});
    stages[s.stage]["sites"].push_back({{"site", s.site},
                                        {"replica", s.replica},
                                        {"micro_batches", s.micro_batches},
                                        {"compute_seconds", s.compute_seconds},
                                        {"wait_seconds", s.wait_seconds},
                                        {"send_seconds", s.send_seconds},
                                        {"codec_seconds", s.codec_seconds}});
  }
  json timeline = json::array();
  for (const auto& a : r.timeline) {
    json e = {{"site", a.site}, {"kind", a.kind}, {"start", a.start}, {"end", a.end}};
    if (a.micro_batch >= 0) e["micro_batch"] = a.micro_batch;
    if (!a.peer.empty()) e["peer"] = a.peer;
    timeline.push_back(std::move(e));
  }
  json j = {{"step_seconds", r.step_seconds},
            {"analytic_step_seconds", r.analytic_step_seconds},
            {"median_step_seconds", r.median_step_seconds},
            {"last_step_seconds", r.last_step_seconds},
            {"step_times", r.step_times},
            {"compute_bound_seconds", r.compute_bound_seconds},
            {"utilisation", r.utilisation},
            {"bubble_fraction", r.bubble_fraction},
            {"links", links},
            {"stages", stages},
            {"timeline", timeline},
            {"notes", r.notes}};
  return j.dump(2) + "\n";
}

std::string SimulationTable(const SimulationResult& r) {
  std::string out = absl::StrFormat(
      "simulated step %.3f s (median %.3f s over %d steps after the first); compute bound %.3f s: utilisation "
      "%.1f%%; bubble %.1f%% of the last step; the analytic model: %.3f s\n",
      r.step_seconds, r.median_step_seconds, static_cast<int>(r.step_times.size()) - 1, r.compute_bound_seconds,
      100 * r.utilisation, 100 * r.bubble_fraction, r.analytic_step_seconds);
  absl::StrAppendFormat(&out, "%-6s %-16s %6s %10s %10s %10s %10s\n", "stage", "site", "mb", "compute_s", "wait_s",
                        "send_s", "codec_s");
  for (const auto& s : r.sites)
    absl::StrAppendFormat(&out, "%-6d %-16s %6d %10.3f %10.3f %10.3f %10.3f\n", s.stage + 1, s.site, s.micro_batches,
                          s.compute_seconds, s.wait_seconds, s.send_seconds, s.codec_seconds);
  if (!r.links.empty()) absl::StrAppendFormat(&out, "%-34s %14s %6s\n", "link", "bytes/step", "busy");
  for (const auto& l : r.links)
    absl::StrAppendFormat(&out, "%-34s %14.0f %5.1f%%\n", l.from + " -> " + l.to, l.bytes, 100 * l.busy_fraction);
  for (const auto& n : r.notes) absl::StrAppend(&out, "note: ", n, "\n");
  return out;
}

std::string TimelineSvg(const SimulationResult& r) {
  // One colour per activity kind; compute in a row's upper band, traffic out of the site in the lower.
  static const std::map<std::string, std::string> kColour = {
      {"forward", "#4e79a7"},    {"backward", "#f28e2b"}, {"recompute", "#76b7b2"},
      {"optimizer", "#edc948"},  {"send", "#59a14f"},     {"sync", "#b07aa1"},
      {"outer_sync", "#e15759"}, {"control", "#9c755f"},  {"wait", "#d3d3d3"}};
  std::vector<std::string> rows;
  for (const auto& s : r.sites) rows.push_back(s.site);
  double span = r.last_step_seconds;
  for (const auto& a : r.timeline) span = std::max(span, a.end);
  if (span <= 0) span = 1;
  const double left = 140, width = 900, row_h = 44, top = 30;
  const double height = top + row_h * rows.size() + 60;
  auto x = [&](double t) { return left + width * std::max(0.0, t) / span; };
  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
      "<text x=\"%.0f\" y=\"18\">last simulated step: %.3f s (utilisation %.1f%%, bubble %.1f%%)</text>\n",
      left + width + 20, height, left, r.last_step_seconds, 100 * r.utilisation, 100 * r.bubble_fraction);
  for (size_t i = 0; i < rows.size(); ++i) {
    const double y = top + row_h * i;
    absl::StrAppendFormat(&svg, "<text x=\"4\" y=\"%.1f\">%s (stage %d)</text>\n", y + row_h / 2, rows[i],
                          r.sites[i].stage + 1);
    absl::StrAppendFormat(&svg, "<line x1=\"%.0f\" x2=\"%.0f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#eee\"/>\n", left,
                          left + width, y + row_h - 2, y + row_h - 2);
  }
  for (const auto& a : r.timeline) {
    auto it = std::find(rows.begin(), rows.end(), a.site);
    auto colour = kColour.find(a.kind);
    if (it == rows.end() || colour == kColour.end()) continue;
    const double y = top + row_h * (it - rows.begin());
    const bool compute = a.kind == "forward" || a.kind == "backward" || a.kind == "recompute" ||
                         a.kind == "optimizer" || a.kind == "wait";
    const double y0 = compute ? y + 2 : y + row_h * 0.55, h = compute ? row_h * 0.5 : row_h * 0.35;
    absl::StrAppendFormat(&svg,
                          "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" fill=\"%s\"><title>%s %s%s "
                          "%.4f-%.4f s</title></rect>\n",
                          x(a.start), y0, std::max(0.5, x(a.end) - x(a.start)), h, colour->second, a.kind,
                          a.micro_batch >= 0 ? absl::StrCat("mb ", a.micro_batch, " ") : "",
                          a.peer.empty() ? "" : "to " + a.peer, a.start, a.end);
  }
  const double ly = top + row_h * rows.size() + 20;
  double lx = left;
  for (const char* k :
       {"forward", "backward", "recompute", "optimizer", "wait", "send", "sync", "outer_sync", "control"}) {
    absl::StrAppendFormat(&svg, "<rect x=\"%.0f\" y=\"%.0f\" width=\"12\" height=\"12\" fill=\"%s\"/>", lx, ly,
                          kColour.at(k));
    absl::StrAppendFormat(&svg, "<text x=\"%.0f\" y=\"%.0f\">%s</text>\n", lx + 16, ly + 11, k);
    lx += 110;
  }
  absl::StrAppendFormat(&svg, "<text x=\"%.0f\" y=\"%.0f\">0 s</text><text x=\"%.0f\" y=\"%.0f\">%.3f s</text>\n", left,
                        ly + 34, left + width - 50, ly + 34, span);
  svg += "</svg>\n";
  return svg;
}

}  // namespace meridian::simulator
