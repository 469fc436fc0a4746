#include "partitioner/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <tuple>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "compression/activation_delta.h"
#include "compression/codec.h"
#include "compression/policy.h"
#include "core/status.h"
#include "partitioner/schedule.h"

namespace meridian::partitioner {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Precomputed per-site and per-cut quantities for O(1) evaluation of any stage or link.
class CostModel {
 public:
  // `pipelined_links`: a deep pipeline covers every link's latency with micro-batches in flight, so a
  // link paces the steady state by its transfer time alone (LinkSteady); else by transfer plus latency.
  // `recompute`: a stage whose memory holds 1F1B's window only with activation recomputation is feasible,
  // at its time with the second forward pass (FittingStageTime; PlanOptions::recompute).
  // `gradient_bytes_fraction`: PlanOptions::gradient_bytes_fraction (GradientBytes).
  CostModel(const OpGraph& g, const ClusterProfile& p, int micro_batches, bool pipelined_links = false, int zero = 0,
            bool recompute = false, double gradient_bytes_fraction = 0.5)
      : graph_(g),
        profile_(p),
        zero_(zero),
        m_(micro_batches),
        n_(static_cast<int>(g.ops.size())),
        sites_(static_cast<int>(p.sites.size())),
        pipelined_(pipelined_links),
        recompute_(recompute) {
    time_prefix_.assign(sites_, std::vector<double>(n_ + 1, 0.0));
    for (int s = 0; s < sites_; ++s)
      for (int i = 0; i < n_; ++i) time_prefix_[s][i + 1] = time_prefix_[s][i] + OpSeconds(g.ops[i], p.sites[s]);
    state_prefix_.assign(n_ + 1, 0.0);
    act_prefix_.assign(n_ + 1, 0.0);
    param_prefix_.assign(n_ + 1, 0.0);
    grad_prefix_.assign(n_ + 1, 0.0);
    forward_prefix_.assign(n_ + 1, 0.0);
    flops_prefix_.assign(n_ + 1, 0.0);
    for (int i = 0; i < n_; ++i) {
      forward_prefix_[i + 1] = forward_prefix_[i] + g.ops[i].forward_flops;
      flops_prefix_[i + 1] = flops_prefix_[i] + g.ops[i].forward_flops + g.ops[i].backward_flops;
      param_prefix_[i + 1] = param_prefix_[i] + g.ops[i].param_bytes;
      grad_prefix_[i + 1] = grad_prefix_[i] + partitioner::GradientBytes(g, i, i, gradient_bytes_fraction);
      state_prefix_[i + 1] = state_prefix_[i] + g.ops[i].param_bytes + g.ops[i].optimizer_bytes;
      act_prefix_[i + 1] = act_prefix_[i] + SavedBytes(g.ops[i]);
    }
    cut_bytes_ = partitioner::CutBytes(g);
    for (int c = 0; c + 1 < n_; ++c)  // a cut between ops sharing weights is never made
      if (CutSeparatesTiedOps(g, c) >= 0) cut_bytes_[c] = kInf;
    bw_.assign(sites_, std::vector<double>(sites_, 0.0));
    lat_.assign(sites_, std::vector<double>(sites_, 0.0));
    receive_.assign(sites_, std::vector<double>(sites_, 0.0));
    std::map<std::string, int> index;
    for (int s = 0; s < sites_; ++s) index[p.sites[s].name] = s;
    for (const auto& l : p.links) {
      int a = index.at(l.from), b = index.at(l.to);
      bw_[a][b] = l.bandwidth_bytes_per_second;
      lat_[a][b] = l.latency_seconds;
      receive_[a][b] = l.receive_seconds_per_byte;
    }
  }

  int ops() const { return n_; }
  int sites() const { return sites_; }
  int micro_batches() const { return m_; }
  // Forward+backward seconds of ops [a, b] on site s, per micro-batch.
  double StageTime(int s, int a, int b) const { return time_prefix_[s][b + 1] - time_prefix_[s][a]; }
  double WholeModelTime(int s) const { return time_prefix_[s][n_]; }
  // Bytes crossing the cut after op p (0 <= p < ops - 1); +inf where the cut separates ops sharing
  // weights (Op::tied_to), so that every search prices it out.
  double CutBytes(int p) const { return cut_bytes_[p]; }
  bool Linked(int a, int b) const { return bw_[a][b] > 0 && bw_[b][a] > 0; }
  // c_k for bytes x between sites a and b (both directions; +inf if they cannot be neighbours).
  // `xb`: the bytes going back (gradients), when they differ from the activations' `x`.
  double LinkCost(int a, int b, double x, double xb = -1) const {
    if (!Linked(a, b)) return kInf;
    return std::max(lat_[a][b] + x / bw_[a][b], lat_[b][a] + (xb < 0 ? x : xb) / bw_[b][a]);
  }
  // What link a-b adds to the steady state per micro-batch: LinkCost, or with pipelined links the
  // slower direction's transfer time only (+inf if they cannot be neighbours).
  double LinkSteady(int a, int b, double x, double xb = -1) const {
    if (!pipelined_) return LinkCost(a, b, x, xb);
    if (!Linked(a, b)) return kInf;
    return std::max(x / bw_[a][b], (xb < 0 ? x : xb) / bw_[b][a]);
  }
  // partitioner::CodecSeconds at site s.
  double CodecSeconds(int s, const std::string& codec, double raw_bytes) const {
    return partitioner::CodecSeconds(profile_.sites[s], codec, raw_bytes);
  }
  // partitioner::OptimizerSeconds of ops [a, b] at site s (the parameters' all-gather under ZeRO-1 is in
  // SiteReduceSeconds).
  double OptimizerSeconds(int s, int a, int b) const {
    return partitioner::OptimizerSeconds(graph_, profile_.sites[s], a, b, zero_);
  }
  // partitioner::TransportSeconds at site s (`receive_seconds_per_byte`: the link's, for a frame received).
  double TransportSeconds(int s, double wire_bytes, double receive_seconds_per_byte = 0) const {
    return partitioner::TransportSeconds(profile_.sites[s], wire_bytes, receive_seconds_per_byte);
  }
  // LinkProfile::receive_seconds_per_byte of the link a -> b (0: not measured, or no link).
  double ReceiveSecondsPerByte(int a, int b) const { return receive_[a][b]; }
  double Bandwidth(int a, int b) const { return bw_[a][b]; }
  double Latency(int a, int b) const { return lat_[a][b]; }
  // Activation memory of ops [a, b] with `in_flight` micro-batches in flight: each one's activations, or
  // with recomputation each one's input (what crosses the cut before op a, CutBytes: +inf after a cut that
  // is never made; the tokens, negligible, for a = 0) plus the activations of the one being recomputed.
  double ActivationMemory(int a, int b, int in_flight, bool recompute) const {
    const double whole = act_prefix_[b + 1] - act_prefix_[a];
    const int n = std::min(m_, in_flight);
    if (!recompute) return n * whole;
    return n * (a == 0 ? 0.0 : cut_bytes_[a - 1]) + whole;
  }
  // Memory of ops [a, b] when the stage is `from_end` stages from the end (1 = last stage), or keeps that
  // many micro-batches in flight.
  double Memory(int a, int b, int from_end, bool recompute = false) const {
    return state_prefix_[b + 1] - state_prefix_[a] + OverlapCopy(a, b) + ActivationMemory(a, b, from_end, recompute);
  }
  // job.step_overlap: the second copy of the weights (and their gradients) the early micro-batches use.
  void set_step_overlap(int k) { step_overlap_ = k; }
  // The deepest any stage may be under it (MaxInFlightForOverlap; no bound without it): also the most stages
  // a layout may have, since the first needs 1F1B's window of one per stage.
  int overlap_depth_cap() const {
    return step_overlap_ > 0 ? MaxInFlightForOverlap(m_, step_overlap_) : std::numeric_limits<int>::max();
  }
  double OverlapCopy(int a, int b) const { return step_overlap_ > 0 ? param_prefix_[b + 1] - param_prefix_[a] : 0.0; }
  // partitioner::GradientBytes of ops [a, b].
  double GradientBytes(int a, int b) const { return grad_prefix_[b + 1] - grad_prefix_[a]; }
  // Memory on site s: Memory for a site of one device; with K workers each holds the weights and gradients,
  // the buckets of the workers' gradient sum (executor::SiteReducer: a copy of the gradients, on the
  // device that sums them), and the optimizer state whole, or a 1/K share under ZeRO-1 (the activations
  // are split by rows).
  double SiteMemory(int s, int a, int b, int from_end, bool recompute = false) const {
    const int k = std::max(1, profile_.sites[s].workers);
    if (k == 1) return Memory(a, b, from_end, recompute);
    const double params = param_prefix_[b + 1] - param_prefix_[a];
    const double optimizer = state_prefix_[b + 1] - state_prefix_[a] - params;
    const double buckets = GradientBytes(a, b);
    return k * (params + buckets + OverlapCopy(a, b)) + (zero_ == 1 ? 1 : k) * optimizer +
           ActivationMemory(a, b, from_end, recompute);
  }
  bool Fits(int s, int a, int b, int from_end, bool recompute = false) const {
    return SiteMemory(s, a, b, from_end, recompute) <= profile_.sites[s].memory_bytes;
  }
  // Whether ops [a, b] may fit site s `from_end` stages from the end: without recomputation, Fits; with
  // it, their state and one micro-batch's activations, the least any window or recomputation holds. It
  // only gets harder as the range grows, so a search may stop there.
  bool MayFit(int s, int a, int b, int from_end) const {
    return recompute_ ? Fits(s, a, b, 1, false) : Fits(s, a, b, from_end);
  }
  // ComputeFactor of ops [a, b] with recomputation, from prefix sums.
  double RecomputeFactor(int a, int b) const {
    const double all = flops_prefix_[b + 1] - flops_prefix_[a];
    return 1 + (all > 0 ? (forward_prefix_[b + 1] - forward_prefix_[a]) / all : 1.0 / 3.0);
  }
  // Whether ops [a, b] on site s, `from_end` stages from the end (1F1B's window of that many micro-batches
  // in flight), fit only with recomputation, and may (the constructor's `recompute`).
  bool NeedsRecompute(int s, int a, int b, int from_end) const {
    return recompute_ && !Fits(s, a, b, from_end) && Fits(s, a, b, from_end, true);
  }
  // Seconds per micro-batch of ops [a, b] on site s, `from_end` stages from the end: StageTime where 1F1B's
  // window fits; with the second forward pass where only recomputation makes it fit (NeedsRecompute);
  // +inf where neither does.
  double FittingStageTime(int s, int a, int b, int from_end) const {
    if (Fits(s, a, b, from_end)) return StageTime(s, a, b);
    if (NeedsRecompute(s, a, b, from_end)) return StageTime(s, a, b) * RecomputeFactor(a, b);
    return kInf;
  }
  // Seconds per step for site s's workers to sum ops [a, b]'s gradients (`gradient_bytes`) with c10d: an
  // all-reduce moving 2 (K-1)/K of them per worker, and under ZeRO-1 the parameters' all-gather, (K-1)/K of
  // them again; 0 for one worker or an unmeasured bandwidth. Charged in full, though the executor starts
  // the sums during the last backward pass.
  double SiteReduceSeconds(int s, double gradient_bytes) const {
    const SiteProfile& site = profile_.sites[s];
    if (site.workers < 2 || site.intra_site_bytes_per_second <= 0) return 0;
    const double share = static_cast<double>(site.workers - 1) / site.workers;
    return (2 + (zero_ == 1 ? 1 : 0)) * share * gradient_bytes / site.intra_site_bytes_per_second;
  }

 private:
  const OpGraph& graph_;
  const ClusterProfile& profile_;
  int zero_;
  int step_overlap_ = 0;
  int m_, n_, sites_;
  bool pipelined_, recompute_;
  std::vector<std::vector<double>> time_prefix_;
  std::vector<double> param_prefix_, grad_prefix_, state_prefix_, act_prefix_, forward_prefix_, flops_prefix_,
      cut_bytes_;
  std::vector<std::vector<double>> bw_, lat_, receive_;  // [from][to]
};

// A candidate pipeline: stage k runs ops (last[k-1], last[k]] on replicas sites[k].
struct Layout {
  std::vector<std::vector<int>> sites;
  std::vector<int> last;
  // Whole-pipeline replicas (GroupPipelines): every stage on P sites, pipeline r being sites[k][r] of
  // every stage, and every stage sharing the micro-batches alike, in proportion to each pipeline's speed
  // (its slowest stage), so that each micro-batch stays within one pipeline. Else each stage shares them
  // by its own sites' speeds.
  bool pipelines = false;
};

struct Evaluation {
  double total = kInf;
  double fill = 0, steady = 0, sync = 0;
  std::vector<double> t, c, allreduce, memory, site_reduce;
  // Stages whose sites hold 1F1B's window only with activation recomputation (CostModel::NeedsRecompute),
  // and per stage its second forward pass per micro-batch (0 elsewhere): t plus it is the stage's time.
  std::vector<bool> recompute;
  std::vector<double> recompute_t;
  std::vector<double> pace;                 // per link: what it adds to the steady state (CostModel::LinkSteady)
  std::vector<int> link_codec, grad_codec;  // indices into the menus; -1 = fixed ratio
  // Per stage: how its sites share the micro-batches (one count per site; {M} for a lone site).
  std::vector<std::vector<int>> shares;
  // Per stage of several sites: MicroBatchOwners(shares[k]), computed once (LinkPairs needs it for every
  // link and codec tried); empty for a lone site.
  std::vector<std::vector<int>> owners;
};

// The pairs of sites (indices into the profile) of stages k and k + 1 that a micro-batch goes between:
// micro-batch m runs on MicroBatchOwners(shares[k])[m] at stage k and on that of shares[k + 1] at stage
// k + 1 (as the executors route it). Replicated stages with the same shares pair their replicas one to one
// (whole pipelines); next to a lone site, every site of the other stage with a share; without shares for
// both stages, every pair. A pair may come more than once (one per micro-batch): callers take maxima.
std::vector<std::pair<int, int>> LinkPairs(const Layout& L, const Evaluation& e, int k) {
  std::vector<std::pair<int, int>> pairs;
  const bool shared = k + 1 < static_cast<int>(e.shares.size()) && e.shares[k].size() == L.sites[k].size() &&
                      e.shares[k + 1].size() == L.sites[k + 1].size();
  if (shared && L.sites[k].size() > 1 && e.shares[k] == e.shares[k + 1]) {
    // The same shares: the same owners, replica i to replica i.
    for (size_t i = 0; i < L.sites[k].size(); ++i)
      if (e.shares[k][i] > 0) pairs.emplace_back(L.sites[k][i], L.sites[k + 1][i]);
  } else if (shared && L.sites[k].size() > 1 && L.sites[k + 1].size() > 1) {
    auto owners = [&](int stage) {
      return stage < static_cast<int>(e.owners.size()) && !e.owners[stage].empty() ? e.owners[stage]
                                                                                   : MicroBatchOwners(e.shares[stage]);
    };
    const std::vector<int> from = owners(k), to = owners(k + 1);
    pairs.reserve(std::min(from.size(), to.size()));
    for (size_t m = 0; m < from.size() && m < to.size(); ++m)  // one per micro-batch, repeats and all
      pairs.emplace_back(L.sites[k][from[m]], L.sites[k + 1][to[m]]);
  } else {
    for (size_t i = 0; i < L.sites[k].size(); ++i)
      for (size_t j = 0; j < L.sites[k + 1].size(); ++j)
        if (!shared || (e.shares[k][i] > 0 && e.shares[k + 1][j] > 0))
          pairs.emplace_back(L.sites[k][i], L.sites[k + 1][j]);
  }
  if (pairs.empty())  // no micro-batches at all: price every pair, as without shares
    for (int a : L.sites[k])
      for (int b : L.sites[k + 1]) pairs.emplace_back(a, b);
  return pairs;
}

// Link k of layout L carrying `codec`: {its c_k (CostModel::LinkCost), what it adds to the steady state
// (CostModel::LinkSteady)}, each the worst over the pairs of sites that micro-batches go between (LinkPairs).
std::pair<double, double> LinkTimes(const CostModel& cm, const Layout& L, const Evaluation& e, int k,
                                    const Codec& codec) {
  const double x = cm.CutBytes(L.last[k]);
  double cost = 0, pace = 0;
  for (auto [a, b] : LinkPairs(L, e, k)) {
    cost = std::max(cost, cm.LinkCost(a, b, codec.ratio * x, codec.backward() * x));
    pace = std::max(pace, cm.LinkSteady(a, b, codec.ratio * x, codec.backward() * x));
  }
  return {cost, pace};
}

// The step-time terms of an evaluation from its stage, link and replica-sync times: fill and drain, the
// steady state paced by the slowest stage or link, the slowest sync.
void SumUp(int micro_batches, Evaluation* e) {
  double sum = 0, mx = 0;
  for (size_t k = 0; k < e->t.size(); ++k) {
    const double t = e->t[k] + e->recompute_t[k];
    sum += t, mx = std::max(mx, t);
  }
  for (size_t k = 0; k < e->c.size(); ++k) sum += e->c[k], mx = std::max(mx, e->pace[k]);
  e->fill = sum;
  e->steady = (micro_batches - 1) * mx;
  e->sync = e->allreduce.empty() ? 0.0 : *std::max_element(e->allreduce.begin(), e->allreduce.end());
  e->total = e->fill + e->steady + e->sync;
}

// How stage k's M micro-batches are shared among its sites, whose seconds per micro-batch are `times`:
// as the caller pinned them (PlanOptions::fixed_shares), else in proportion to speed.
std::vector<int> StageShares(const PlanOptions& o, int k, int M, const std::vector<double>& times) {
  if (k < static_cast<int>(o.fixed_shares.size()) && !o.fixed_shares[k].empty()) return o.fixed_shares[k];
  return ShareMicroBatches(M, times);
}

// Evaluates a layout under the (extended) cost model. With one site per stage and adaptive off this is
// exactly the reference model. `search_ratio` is the link ratio used when !adaptive.
// One exchange of `grad` bytes among `r` replicas, in a codec of `ratio`: the reduce-scatter + all-gather
// (each of the two phases sends 1/r of the bytes to every other replica) or, with `sparse_sum`,
// SparseLoCo's all-gather (the whole vector to every other replica once). A site's sends share its
// uplink: `inv_bw` is the largest over the replicas' sites of the sum over its peers of 1 / bandwidth;
// `max_lat` the worst latency between them, paid once a phase.
double ReplicaExchangeSeconds(double grad, int r, double inv_bw, double max_lat, double ratio, bool sparse_sum) {
  if (sparse_sum) return ratio * grad * inv_bw + max_lat;
  return 2.0 * (ratio * grad / r * inv_bw + max_lat);
}

Evaluation Evaluate(const CostModel& cm, const Layout& L, const PlanOptions& o, const OpGraph& g) {
  Evaluation e;
  const int S = static_cast<int>(L.sites.size());
  const int M = cm.micro_batches();
  e.t.resize(S);
  e.memory.resize(S);
  e.allreduce.assign(S, 0.0);
  e.grad_codec.assign(S, -1);
  e.recompute.assign(S, false);
  e.recompute_t.assign(S, 0.0);
  e.shares.assign(S, {});
  // job.step_overlap: stage 0 needs 1F1B's window of S within the depth the overlap leaves.
  if (S > cm.overlap_depth_cap()) return e;
  // Whole pipelines: one share per pipeline, from its slowest stage, for every stage.
  std::vector<int> pipeline_shares;
  if (L.pipelines && S > 0 && L.sites[0].size() > 1) {
    std::vector<double> slowest(L.sites[0].size(), 0);
    for (int k = 0; k < S; ++k) {
      if (L.sites[k].size() != slowest.size()) return e;
      const int a = k == 0 ? 0 : L.last[k - 1] + 1, b = L.last[k];
      if (a > b) return e;
      for (size_t r = 0; r < slowest.size(); ++r) slowest[r] = std::max(slowest[r], cm.StageTime(L.sites[k][r], a, b));
    }
    pipeline_shares = ShareMicroBatches(M, slowest);
  }
  double max_t = 0;
  for (int k = 0; k < S; ++k) {
    int a = k == 0 ? 0 : L.last[k - 1] + 1, b = L.last[k];
    if (a > b) return e;
    // A stage recomputes where one of its sites needs it (the executor does it stage-wide).
    for (int s : L.sites[k]) {
      if (cm.NeedsRecompute(s, a, b, S - k))
        e.recompute[k] = true;
      else if (!cm.Fits(s, a, b, S - k))
        return e;
    }
    // Replicas share the micro-batches in proportion to speed (ShareMicroBatches); the stage's time per
    // micro-batch is its slowest replica's share of the step, spread over the M micro-batches.
    std::vector<double> times;
    for (int s : L.sites[k]) times.push_back(cm.StageTime(s, a, b));
    if (times.size() == 1) {
      e.t[k] = times[0];
      e.shares[k] = {M};
    } else {
      const bool pinned = k < static_cast<int>(o.fixed_shares.size()) && !o.fixed_shares[k].empty();
      const std::vector<int> share = pipeline_shares.empty() || pinned ? StageShares(o, k, M, times) : pipeline_shares;
      e.shares[k] = share;
      if (e.owners.size() != static_cast<size_t>(S)) e.owners.assign(S, {});
      e.owners[k] = MicroBatchOwners(share);
      double slowest = 0;
      for (size_t i = 0; i < times.size(); ++i) slowest = std::max(slowest, share[i] * times[i]);
      e.t[k] = slowest / M;
    }
    if (e.recompute[k]) e.recompute_t[k] = e.t[k] * (ComputeFactor(g, a, b, true) - 1);
    e.memory[k] = 0;
    for (int s : L.sites[k]) e.memory[k] = std::max(e.memory[k], cm.SiteMemory(s, a, b, S - k, e.recompute[k]));
    max_t = std::max(max_t, e.t[k] + e.recompute_t[k]);
  }
  e.c.resize(std::max(S - 1, 0));
  e.pace.resize(std::max(S - 1, 0));
  e.link_codec.assign(std::max(S - 1, 0), -1);
  for (int k = 0; k + 1 < S; ++k) {
    Codec codec{"", o.ratio};
    if (o.adaptive_compression) {
      // The lightest codec whose steady-state link time stays within the compute bottleneck; else the
      // strongest.
      int pick = static_cast<int>(o.link_codecs.size()) - 1;
      for (int i = 0; i < static_cast<int>(o.link_codecs.size()); ++i)
        if (LinkTimes(cm, L, e, k, o.link_codecs[i]).second <= max_t) {
          pick = i;
          break;
        }
      e.link_codec[k] = pick;
      codec = o.link_codecs[pick];
    }
    std::tie(e.c[k], e.pace[k]) = LinkTimes(cm, L, e, k, codec);
    if (e.c[k] == kInf) return e;
  }
  // Replica gradient sync: the executors' reduce-scatter + all-gather (docs/executor.md). Each of the two
  // phases sends 1/r of the gradients to every other replica; a site's sends share its uplink, so a phase
  // lasts as long as the slowest site's sends, plus the worst latency.
  for (int k = 0; k < S; ++k) {
    const auto& R = L.sites[k];
    int r = static_cast<int>(R.size());
    if (r < 2) continue;
    int a = k == 0 ? 0 : L.last[k - 1] + 1, b = L.last[k];
    double grad = cm.GradientBytes(a, b);
    double inv_bw = 0, max_lat = 0;  // max over sites of sum over peers of 1 / bandwidth
    for (int u : R) {
      double sum = 0;
      for (int v : R) {
        if (u == v) continue;
        if (!cm.Linked(u, v)) return e;
        sum += 1.0 / cm.Bandwidth(u, v);
        max_lat = std::max(max_lat, cm.Latency(u, v));
      }
      inv_bw = std::max(inv_bw, sum);
    }
    auto sync = [&](double ratio) { return ReplicaExchangeSeconds(grad, r, inv_bw, max_lat, ratio, false); };
    if (o.sync.diloco) {  // a whole exchange every H steps; its per-step share is settled below
      e.allreduce[k] = ReplicaExchangeSeconds(grad, r, inv_bw, max_lat, o.sync.codec.ratio, o.sync.sparse_sum);
      continue;
    }
    if (!o.adaptive_compression) {
      e.allreduce[k] = sync(1.0);
    } else {
      int pick = static_cast<int>(o.gradient_codecs.size()) - 1;
      for (int i = 0; i < static_cast<int>(o.gradient_codecs.size()); ++i)
        if (sync(o.gradient_codecs[i].ratio) <= e.t[k] + e.recompute_t[k]) {
          pick = i;
          break;
        }
      e.grad_codec[k] = pick;
      e.allreduce[k] = sync(o.gradient_codecs[pick].ratio);
    }
  }
  if (o.sync.diloco) {
    // Per step: the exchange / H, or with overlap what the exchanges take beyond the H steps of compute
    // they run beside (each fragment's exchange, 1/F of the bytes, beside H/F steps).
    Evaluation compute = e;
    std::fill(compute.allreduce.begin(), compute.allreduce.end(), 0.0);
    SumUp(M, &compute);
    const double H = std::max(1, o.sync.inner_steps);
    for (double& x : e.allreduce) x = o.sync.overlap ? std::max(0.0, x - H * compute.total) / H : x / H;
  }
  // Sites of several devices: their workers' gradient sum, every step.
  e.site_reduce.assign(S, 0.0);
  for (int k = 0; k < S; ++k) {
    int a = k == 0 ? 0 : L.last[k - 1] + 1, b = L.last[k];
    for (int s : L.sites[k])
      e.site_reduce[k] = std::max(e.site_reduce[k], cm.SiteReduceSeconds(s, cm.GradientBytes(a, b)));
    e.allreduce[k] += e.site_reduce[k];
  }
  SumUp(M, &e);
  return e;
}

// Link k's codec in an evaluated layout: the menu's choice, or the fixed ratio (unnamed) without one.
Codec LinkCodecOf(const Evaluation& ev, const PlanOptions& o, int k) {
  return ev.link_codec[k] >= 0 ? o.link_codecs[ev.link_codec[k]] : Codec{"", o.ratio};
}

// Stage k's work per micro-batch on its compute thread for the frames its passes handle, (forward pass,
// backward pass), at the slowest of its sites: the forward pass takes its input activation and produces
// its output, the backward pass takes the incoming gradient and produces the outgoing one.
// `frame(s, codec, raw_bytes, backward, receive)` prices one frame of link codec `codec` at site s;
// `receive` is, for a frame s receives, the costliest receive per byte over the links from the sending
// stage's sites (CostModel::ReceiveSecondsPerByte), and 0 for a frame it sends.
template <typename FrameSeconds>
std::pair<double, double> PassWork(const CostModel& cm, const Layout& L, const Evaluation& ev, const PlanOptions& o,
                                   int k, FrameSeconds frame) {
  const int S = static_cast<int>(L.sites.size());
  auto receive = [&](int s, int from_stage) {
    double r = 0;
    for (int p : L.sites[from_stage]) r = std::max(r, cm.ReceiveSecondsPerByte(p, s));
    return r;
  };
  double forward = 0, backward = 0;
  for (int s : L.sites[k]) {
    double f = 0, b = 0;
    for (int j : {k - 1, k}) {
      if (j < 0 || j + 1 >= S) continue;
      const Codec codec = LinkCodecOf(ev, o, j);
      // Link j = k - 1 brings the forward pass its activations; link j = k the backward pass its gradients.
      f += frame(s, codec, cm.CutBytes(L.last[j]), false, j == k - 1 ? receive(s, k - 1) : 0.0);
      b += frame(s, codec, cm.CutBytes(L.last[j]), true, j == k ? receive(s, k + 1) : 0.0);
    }
    forward = std::max(forward, f);
    backward = std::max(backward, b);
  }
  return {forward, backward};
}

// Codec work: decoding and encoding each frame (CodecSeconds; gradients in the codec behind the link's).
std::pair<double, double> PassCodecSeconds(const CostModel& cm, const Layout& L, const Evaluation& ev,
                                           const PlanOptions& o, int k) {
  return PassWork(cm, L, ev, o, k, [&](int s, const Codec& codec, double raw, bool backward, double) {
    return cm.CodecSeconds(s, backward ? compression::GradientCodecBehind(codec.name) : codec.name, raw);
  });
}

// Transport work: receiving and sending each frame at its wire bytes (TransportSeconds; a received frame at
// its link's receive cost where that is the larger).
std::pair<double, double> PassTransportSeconds(const CostModel& cm, const Layout& L, const Evaluation& ev,
                                               const PlanOptions& o, int k) {
  return PassWork(cm, L, ev, o, k, [&](int s, const Codec& codec, double raw, bool backward, double receive) {
    return cm.TransportSeconds(s, (backward ? codec.backward() : codec.ratio) * raw, receive);
  });
}

// The per-stage and per-link times of an evaluated layout, as the schedule simulator takes them: each
// stage's time per micro-batch split into forward and backward by its ops' FLOPs, and each pass's codec
// and transport work on its frames (PassCodecSeconds, PassTransportSeconds), which each replica of a
// replicated stage does in full for its own micro-batches; each direction of a link at its codec's bytes
// over the worst pair of sites that micro-batches go between (LinkPairs).
PipelineTimes TimesOf(const CostModel& cm, const Layout& L, const Evaluation& ev, const PlanOptions& o,
                      const OpGraph& g, const std::vector<bool>& recompute) {
  PipelineTimes t;
  const int S = static_cast<int>(L.sites.size());
  t.micro_batches = cm.micro_batches();
  t.step_overlap = o.step_overlap;
  for (int k = 0; k < S; ++k) {
    const int a = k == 0 ? 0 : L.last[k - 1] + 1, b = L.last[k];
    const double share = ForwardShare(g, a, b);
    const auto [forward_codec, backward_codec] = PassCodecSeconds(cm, L, ev, o, k);
    const auto [forward_transport, backward_transport] = PassTransportSeconds(cm, L, ev, o, k);
    t.forward_seconds.push_back(ev.t[k] * share);
    t.backward_seconds.push_back(ev.t[k] * (1 - share));
    t.forward_frame_seconds.push_back(forward_codec + forward_transport);
    t.backward_frame_seconds.push_back(backward_codec + backward_transport);
    // A recomputing stage runs the forward pass again before each backward pass.
    t.recompute_seconds.push_back(recompute[k] ? ev.t[k] * (ComputeFactor(g, a, b, true) - 1) : 0.0);
  }
  for (int k = 0; k + 1 < S; ++k) {
    const Codec codec = LinkCodecOf(ev, o, k);
    const double x = codec.ratio * cm.CutBytes(L.last[k]), xb = codec.backward() * cm.CutBytes(L.last[k]);
    double fx = 0, fl = 0, bx = 0, bl = 0;
    for (auto [a, b] : LinkPairs(L, ev, k)) {
      fx = std::max(fx, x / cm.Bandwidth(a, b));
      fl = std::max(fl, cm.Latency(a, b));
      bx = std::max(bx, xb / cm.Bandwidth(b, a));
      bl = std::max(bl, cm.Latency(b, a));
    }
    t.forward_transfer_seconds.push_back(fx);
    t.forward_latency_seconds.push_back(fl);
    t.backward_transfer_seconds.push_back(bx);
    t.backward_latency_seconds.push_back(bl);
  }
  // Replicated stages: which replica runs each micro-batch, and how long a pass takes at each replica's
  // site against the stage's combined pace (ev.t).
  t.owners.assign(S, {});
  t.replica_scale.assign(S, {});
  for (int k = 0; k < S; ++k) {
    if (L.sites[k].size() < 2 || k >= static_cast<int>(ev.owners.size()) || ev.owners[k].empty() || ev.t[k] <= 0)
      continue;
    const int a = k == 0 ? 0 : L.last[k - 1] + 1, b = L.last[k];
    t.owners[k] = ev.owners[k];
    for (int s : L.sites[k]) t.replica_scale[k].push_back(cm.StageTime(s, a, b) / ev.t[k]);
  }
  return t;
}

// A layout's schedule: each stage's in-flight depth (ChooseInFlight, within what its sites' memory holds)
// and whether it recomputes its activations, the simulated step, plus the replicas' gradient sync.
struct SimulatedLayout {
  double total = kInf;            // the simulated step, the replicas' sync and the slowest optimizer step
  std::vector<double> optimizer;  // per stage: its slowest site's optimizer step (CostModel::OptimizerSeconds)
  std::vector<int> in_flight;
  std::vector<bool> recompute;
  SimulatedStep step;
};

// With `fixed`, its in-flight depths and recomputation rather than choosing them (a quick trial of a
// layout's codecs). Otherwise each stage's depth is capped by its memory (ChooseInFlight), with
// recomputation at the stages that need it for 1F1B's window (Evaluation::recompute); then, with
// PlanOptions::recompute, each other stage held at a cap below the micro-batches that would be deeper with
// recomputation tries it, first to last, and keeps it when the simulated step gets more than 1% shorter
// (a second forward pass costs compute and energy for what memory could otherwise buy).
SimulatedLayout SimulateLayout(const CostModel& cm, const Layout& L, const Evaluation& ev, const PlanOptions& o,
                               const OpGraph& g, const SimulatedLayout* fixed = nullptr) {
  SimulatedLayout r;
  if (ev.total == kInf) return r;
  const int S = static_cast<int>(L.sites.size()), M = cm.micro_batches();
  // Once a step, after the passes and the norm: each stage's optimizer (the slowest one's lengthens it).
  std::vector<double> optimizer(S, 0.0);
  for (int k = 0; k < S; ++k)
    for (int s : L.sites[k])
      optimizer[k] = std::max(optimizer[k], cm.OptimizerSeconds(s, k == 0 ? 0 : L.last[k - 1] + 1, L.last[k]));
  const double slowest_optimizer = *std::max_element(optimizer.begin(), optimizer.end());
  // Simulates the layout at `depths`, or at ChooseInFlight's depths within `cap`.
  auto run = [&](const std::vector<int>& depths, const std::vector<bool>& recompute, const std::vector<int>* cap) {
    SimulatedLayout x;
    PipelineTimes t = TimesOf(cm, L, ev, o, g, recompute);
    // job.step_overlap: the simulation's steady step holds each stage's optimizer step where it runs.
    if (t.step_overlap > 0) t.optimizer_seconds = optimizer;
    x.in_flight = cap ? ChooseInFlight(t, *cap) : depths;
    x.recompute = recompute;
    t.in_flight = x.in_flight;
    x.step = SimulatePipeline(t);
    x.optimizer = optimizer;
    x.total = x.step.step_seconds + ev.sync + (t.step_overlap > 0 ? 0.0 : slowest_optimizer);
    return x;
  };
  if (fixed) return run(fixed->in_flight, fixed->recompute, nullptr);
  // The deepest each stage's sites hold, without and with recomputation.
  auto cap_of = [&](int k, bool recompute) {
    const int a = k == 0 ? 0 : L.last[k - 1] + 1, b = L.last[k];
    int d = std::min(M, S - k);
    while (d < M &&
           std::all_of(L.sites[k].begin(), L.sites[k].end(), [&](int s) { return cm.Fits(s, a, b, d + 1, recompute); }))
      ++d;
    return d;
  };
  // A stage whose memory holds 1F1B's window only with recomputation (Evaluation::recompute) recomputes.
  std::vector<bool> recompute = ev.recompute;
  std::vector<int> cap(S);
  // job.step_overlap bounds every stage's depth (Evaluate left out layouts where 1F1B's window exceeds it).
  const int overlap_cap = cm.overlap_depth_cap();
  for (int k = 0; k < S; ++k) cap[k] = std::min(cap_of(k, recompute[k]), overlap_cap);
  r = run({}, recompute, &cap);
  if (!o.recompute) return r;
  for (int k = 0; k < S; ++k) {
    // Only where memory set the depth: a stage shallower than its cap has all the depth it wants.
    if (recompute[k] || cap[k] >= M || r.in_flight[k] < cap[k]) continue;
    const int deeper = std::min(cap_of(k, true), overlap_cap);
    if (deeper <= cap[k]) continue;
    std::vector<int> trial_cap = cap;
    std::vector<bool> trial = recompute;
    trial_cap[k] = deeper;
    trial[k] = true;
    SimulatedLayout x = run({}, trial, &trial_cap);
    if (x.total < r.total * 0.99) r = std::move(x), cap = trial_cap, recompute = trial;
  }
  return r;
}

// With deep_pipeline and adaptive compression: the formula's codec choice keeps each link's transfer
// within the slowest stage's pass, but a step's fill and drain also carry every transfer once, so with
// few micro-batches a stronger codec can shorten the step; and a codec's work on the compute thread
// (CodecSeconds) can make a stronger codec slower. So the fastest assignment sets the bar: every link
// at the strongest codec, then each link, first to last, at the codec that gives the shortest simulated
// step. Then each link, first to last, gets the lightest codec of the menu that keeps the simulated step
// within 1% of that bar (the lighter the codec, the closer the training to identity's); one bar for the
// whole pipeline, so that a link relaxed against its own could not leave an earlier one the bottleneck.
// Updates `ev` (codecs, link times, fill and steady terms) and sets `sim` to the simulation of the result.
void ChooseLinkCodecsBySimulation(const CostModel& cm, const Layout& L, const PlanOptions& o, const OpGraph& g,
                                  Evaluation* ev, SimulatedLayout* sim) {
  const int S = static_cast<int>(L.sites.size());
  const int strongest = static_cast<int>(o.link_codecs.size()) - 1;
  auto set = [&](Evaluation* e, int k, int codec) {
    e->link_codec[k] = codec;
    std::tie(e->c[k], e->pace[k]) = LinkTimes(cm, L, *e, k, o.link_codecs[codec]);
  };
  Evaluation trial = *ev;
  for (int k = 0; k + 1 < S; ++k) set(&trial, k, strongest);
  *sim = SimulateLayout(cm, L, trial, o, g);
  // Beyond kDepthsPerTrial stages each trial keeps the first simulation's depths (ChooseInFlight per trial
  // would cost links x codecs x its search), and the depths are chosen once more for the codecs chosen.
  constexpr int kDepthsPerTrial = 8;
  const SimulatedLayout bar = *sim;
  const SimulatedLayout* fixed = S > kDepthsPerTrial ? &bar : nullptr;
  // The fastest assignment: each link at its quickest codec, the earlier links' choices kept.
  for (int k = 0; k + 1 < S; ++k)
    for (int codec = 0; codec < strongest; ++codec) {
      Evaluation other = trial;
      set(&other, k, codec);
      SimulatedLayout st = SimulateLayout(cm, L, other, o, g, fixed);
      if (st.total < sim->total * (1 - 1e-9)) {
        trial = other;
        *sim = st;
      }
    }
  const double limit = sim->total * 1.01;
  // Then each link relaxed to the lightest codec within the bar.
  for (int k = 0; k + 1 < S; ++k)
    for (int codec = 0; codec < trial.link_codec[k]; ++codec) {
      Evaluation lighter = trial;
      set(&lighter, k, codec);
      SimulatedLayout st = SimulateLayout(cm, L, lighter, o, g, fixed);
      if (st.total <= limit) {
        trial = lighter;
        *sim = st;
        break;
      }
    }
  if (fixed) *sim = SimulateLayout(cm, L, trial, o, g);
  *ev = trial;
  SumUp(cm.micro_batches(), ev);
}

// The link ratio used while searching: the fixed ratio, or the strongest codec when adaptive (the
// adaptive pass then relaxes each link to the lightest codec that keeps it off the critical path).
double SearchRatio(const PlanOptions& o) {
  if (!o.adaptive_compression) return o.ratio;
  double r = 1.0;
  for (const auto& c : o.link_codecs) r = std::min(r, c.ratio);
  return r;
}

// Reference T for a single-site-per-stage layout with the search ratio (a stage that fits only with
// recomputation at its time with it, CostModel::FittingStageTime). +inf if infeasible.
double SearchCost(const CostModel& cm, const std::vector<int>& order, const std::vector<int>& last, double ratio) {
  const int S = static_cast<int>(order.size());
  const int M = cm.micro_batches();
  if (S > cm.overlap_depth_cap()) return kInf;
  double sum = 0, mx = 0;
  for (int k = 0; k < S; ++k) {
    int a = k == 0 ? 0 : last[k - 1] + 1, b = last[k];
    if (a > b) return kInf;
    const double t = cm.FittingStageTime(order[k], a, b, S - k);
    if (t == kInf) return kInf;
    sum += t;
    mx = std::max(mx, t);
    if (k + 1 < S) {
      double c = cm.LinkCost(order[k], order[k + 1], ratio * cm.CutBytes(b));
      if (c == kInf) return kInf;
      sum += c;
      mx = std::max(mx, cm.LinkSteady(order[k], order[k + 1], ratio * cm.CutBytes(b)));
    }
  }
  return sum + (M - 1) * mx;
}

// ---- Exact search: dynamic programme over (used sites, first site of the suffix, first op of the
// suffix), keeping the Pareto front of (sum of stage and link times, bottleneck) since
// T = sum + (M - 1) * bottleneck is increasing in both. The suffix is built from the last stage
// backwards so that each stage's memory term min(M, S - k + 1) is known when it is added.
struct Entry {
  double sum, mx;
  int64_t parent_state;  // -1 for the last stage
  int32_t parent_entry;
};

struct ExactResult {
  bool complete = false;
  double best = kInf;
  std::vector<int> order, last;
  double transitions = 0;
  // The best pipeline with each number of stages that has one (by the formula), fewest stages first.
  struct PerStages {
    double cost = kInf;
    std::vector<int> order, last;
  };
  std::vector<PerStages> by_stages;
};

ExactResult ExactSearch(const CostModel& cm, double ratio, double upper_bound, double work_limit) {
  ExactResult r;
  const int n = cm.sites(), N = cm.ops(), M = cm.micro_batches();
  const int64_t masks = int64_t{1} << n;
  auto key = [&](int64_t mask, int s, int p) { return (mask * n + s) * N + p; };
  std::vector<std::vector<Entry>> front(static_cast<size_t>(masks * n * N));
  const double bound = upper_bound * (1 + 1e-12) + 1e-300;
  auto insert = [&](std::vector<Entry>& f, const Entry& e) {
    for (const Entry& x : f)
      if (x.sum <= e.sum && x.mx <= e.mx) return;
    f.erase(std::remove_if(f.begin(), f.end(), [&](const Entry& x) { return e.sum <= x.sum && e.mx <= x.mx; }),
            f.end());
    f.push_back(e);
  };
  // Growing a stage's range only adds to its least memory (CostModel::MayFit) and to its time without
  // recomputation: past either bound no longer range can do. (Whether it needs recomputation, and so its
  // time with it, can change either way: the input it keeps is the cut before it.)
  for (int s = 0; s < n; ++s)
    for (int p = N - 1; p >= 0; --p) {
      if (!cm.MayFit(s, p, N - 1, 1) || M * cm.StageTime(s, p, N - 1) > bound) break;
      const double t = cm.FittingStageTime(s, p, N - 1, 1);
      if (M * t > bound) continue;
      front[key(int64_t{1} << s, s, p)].push_back({t, t, -1, -1});
    }
  for (int64_t mask = 1; mask < masks; ++mask) {
    const int used = __builtin_popcountll(static_cast<unsigned long long>(mask));
    for (int s = 0; s < n; ++s) {
      if (!(mask >> s & 1)) continue;
      for (int p = 1; p < N; ++p) {
        const auto& f = front[key(mask, s, p)];
        if (f.empty()) continue;
        for (int s2 = 0; s2 < n; ++s2) {
          if (mask >> s2 & 1) continue;
          double c = cm.LinkCost(s2, s, ratio * cm.CutBytes(p - 1));
          if (c == kInf) continue;
          const double pace = cm.LinkSteady(s2, s, ratio * cm.CutBytes(p - 1));
          const int64_t nmask = mask | (int64_t{1} << s2);
          for (int q = p - 1; q >= 0; --q) {
            if (!cm.MayFit(s2, q, p - 1, used + 1) || M * cm.StageTime(s2, q, p - 1) > bound) break;
            const double t = cm.FittingStageTime(s2, q, p - 1, used + 1);
            if (M * t > bound) continue;
            auto& nf = front[key(nmask, s2, q)];
            for (int32_t ei = 0; ei < static_cast<int32_t>(f.size()); ++ei) {
              const Entry& e = f[ei];
              Entry ne{e.sum + t + c, std::max({e.mx, t, pace}), key(mask, s, p), ei};
              r.transitions += 1;
              if (ne.sum + (M - 1) * ne.mx > bound) continue;
              insert(nf, ne);
            }
            if (r.transitions > work_limit) return r;
          }
        }
      }
    }
  }
  // The best pipeline overall, and the best one for each number of stages (from the number of sites the
  // state has used): deep_pipeline compares those by simulating their schedules.
  std::vector<double> best_t(n + 1, kInf);
  std::vector<int64_t> best_state(n + 1, -1);
  std::vector<int32_t> best_entry(n + 1, -1);
  for (int64_t mask = 1; mask < masks; ++mask) {
    const int stages = __builtin_popcountll(static_cast<unsigned long long>(mask));
    // job.step_overlap: no more stages than the first stage's bounded depth runs 1F1B with.
    if (stages > cm.overlap_depth_cap()) continue;
    for (int s = 0; s < n; ++s) {
      const auto& f = front[key(mask, s, 0)];
      for (int32_t i = 0; i < static_cast<int32_t>(f.size()); ++i) {
        double T = f[i].sum + (M - 1) * f[i].mx;
        if (T < best_t[stages]) {
          best_t[stages] = T;
          best_state[stages] = key(mask, s, 0);
          best_entry[stages] = i;
        }
      }
    }
  }
  r.complete = true;
  auto path = [&](int64_t st, int32_t entry, std::vector<int>* order, std::vector<int>* last) {
    while (st >= 0) {
      int s = static_cast<int>((st / N) % n);
      const Entry& e = front[st][entry];
      order->push_back(s);
      if (e.parent_state < 0) {
        last->push_back(N - 1);
        break;
      }
      last->push_back(static_cast<int>(e.parent_state % N) - 1);
      entry = e.parent_entry;
      st = e.parent_state;
    }
  };
  for (int k = 1; k <= n; ++k) {
    if (best_state[k] < 0) continue;
    ExactResult::PerStages c;
    c.cost = best_t[k];
    path(best_state[k], best_entry[k], &c.order, &c.last);
    if (c.cost < r.best) r.best = c.cost, r.order = c.order, r.last = c.last;
    r.by_stages.push_back(std::move(c));
  }
  return r;
}

// ---- Heuristic: candidate site orders (the K fastest sites, ordered by speed or chained along the best
// links; chains along the widest links from each of the fastest few sites), each cut by binary search on
// the bottleneck, then cuts refined by local moves.
struct Candidate {
  double cost = kInf;
  std::vector<int> order, last;
};

// Greedy cut for a bottleneck B; false if infeasible. Memory is checked conservatively as if all
// sites of `order` were used, which can only over-estimate the in-flight activations (and so time a
// stage with recomputation that the pipeline finally cut would not need: SearchCost settles it). With
// recomputation the greedy cut is a heuristic for feasibility too: whether a stage fits with it depends
// on the cut before it (its input), which ending the previous stage as late as possible may not favour.
bool CutsForBottleneck(const CostModel& cm, const std::vector<int>& order, double ratio, double B,
                       std::vector<int>* last) {
  const int K = static_cast<int>(order.size()), N = cm.ops();
  last->clear();
  int a = 0;
  for (int k = 0; k < K && a < N; ++k) {
    int s = order[k];
    int b = a - 1;
    while (b + 1 < N && cm.FittingStageTime(s, a, b + 1, K - k) <= B) ++b;
    if (b < a) return false;
    if (b == N - 1) {
      last->push_back(b);
      return true;
    }
    if (k + 1 == K) return false;
    while (b >= a && cm.LinkSteady(s, order[k + 1], ratio * cm.CutBytes(b)) > B) --b;
    if (b < a) return false;
    last->push_back(b);
    a = b + 1;
  }
  return false;
}

void Refine(const CostModel& cm, const std::vector<int>& order, double ratio, std::vector<int>* last, double* cost) {
  // Coordinate descent: move each cut to its best position between its neighbours (a full line search
  // when the stage pair is short, else steps of 1 and 4), until no move helps.
  const std::vector<int> used(order.begin(), order.begin() + last->size());
  bool improved = true;
  for (int round = 0; improved && round < 32; ++round) {
    improved = false;
    for (size_t k = 0; k + 1 < last->size(); ++k) {
      int lo = k == 0 ? 0 : (*last)[k - 1] + 1, hi = (*last)[k + 1] - 1;
      std::vector<int> positions;
      if (hi - lo <= 64) {
        for (int p = lo; p <= hi; ++p) positions.push_back(p);
      } else {
        for (int step : {-4, -1, 1, 4}) positions.push_back((*last)[k] + step);
      }
      for (int p : positions) {
        if (p < lo || p > hi || p == (*last)[k]) continue;
        std::vector<int> trial = *last;
        trial[k] = p;
        double c = SearchCost(cm, used, trial, ratio);
        if (c < *cost * (1 - 1e-12)) {
          *cost = c;
          *last = trial;
          improved = true;
        }
      }
    }
  }
}

// Cuts a fixed site order: bisection on the bottleneck, then coordinate descent on the cuts.
Candidate CutOrder(const CostModel& cm, const std::vector<int>& order, double ratio) {
  const int N = cm.ops();
  Candidate none;
  // Every stage's time is within its site's whole model, twice that with recomputation (a forward pass
  // is never more than the whole pass).
  double hi = 0;
  for (int s : order) hi = std::max(hi, 2 * cm.WholeModelTime(s));
  for (int i = 0; i + 1 < N; ++i)
    for (size_t k = 0; k + 1 < order.size(); ++k) {
      double c = cm.LinkSteady(order[k], order[k + 1], ratio * cm.CutBytes(i));
      if (c != kInf) hi = std::max(hi, c);
    }
  std::vector<int> last;
  if (!CutsForBottleneck(cm, order, ratio, hi * (1 + 1e-9), &last)) return none;
  double lo = 0;
  for (int it = 0; it < 60 && hi - lo > 1e-9 * hi; ++it) {
    double mid = 0.5 * (lo + hi);
    std::vector<int> trial;
    if (CutsForBottleneck(cm, order, ratio, mid, &trial))
      hi = mid, last = trial;
    else
      lo = mid;
  }
  std::vector<int> used(order.begin(), order.begin() + last.size());
  double cost = SearchCost(cm, used, last, ratio);
  if (cost == kInf) return none;
  Refine(cm, order, ratio, &last, &cost);
  return {cost, used, last};
}

// Local search over the sites of `best`'s pipeline: replace one stage's site by an unused one, or swap
// two stages' sites, re-cutting each time; move to any improvement until none helps. Bounded by a budget
// of evaluations.
Candidate LocalSearch(const CostModel& cm, double ratio, Candidate best) {
  const int n = cm.sites(), N = cm.ops();
  double budget = 3e7;
  for (bool improved = best.cost < kInf; improved && budget > 0;) {
    improved = false;
    std::vector<bool> in_use(n, false);
    for (int s : best.order) in_use[s] = true;
    const int S = static_cast<int>(best.order.size());
    for (int k = 0; k < S && !improved && budget > 0; ++k) {
      for (int s = 0; s < n + S && !improved && budget > 0; ++s) {
        std::vector<int> order = best.order;
        if (s < n) {
          if (in_use[s]) continue;
          order[k] = s;
        } else {
          int j = s - n;
          if (j <= k) continue;
          std::swap(order[k], order[j]);
        }
        budget -= 64.0 * N;
        Candidate c = CutOrder(cm, order, ratio);
        if (c.cost < best.cost * (1 - 1e-9)) {
          best = c;
          improved = true;
        }
      }
    }
  }
  return best;
}

// The site of `candidates`, not `taken` and linked with `from` both ways, with the widest link from it
// (the narrower direction counts); -1 when there is none.
int WidestLinkFrom(const CostModel& cm, int from, const std::vector<int>& candidates, const std::vector<bool>& taken) {
  int pick = -1;
  double best_bw = -1;
  for (int s : candidates)
    if (!taken[s] && cm.Linked(from, s)) {
      const double bw = std::min(cm.Bandwidth(from, s), cm.Bandwidth(s, from));
      if (bw > best_bw) best_bw = bw, pick = s;
    }
  return pick;
}

Candidate Heuristic(const CostModel& cm, double ratio) {
  const int n = cm.sites(), N = cm.ops();
  std::vector<int> by_speed(n);
  std::iota(by_speed.begin(), by_speed.end(), 0);
  std::stable_sort(by_speed.begin(), by_speed.end(),
                   [&](int a, int b) { return cm.WholeModelTime(a) < cm.WholeModelTime(b); });
  Candidate best;
  std::vector<int> ks;
  for (int k = 1; k <= std::min(n, N); ++k)
    if (k <= 32 || k % 8 == 0 || k == std::min(n, N)) ks.push_back(k);
  for (int K : ks) {
    std::vector<int> subset(by_speed.begin(), by_speed.begin() + K);
    // Order 1: by speed. Order 2: chain from the fastest along the widest available link.
    std::vector<std::vector<int>> orders = {subset};
    std::vector<int> chain = {subset[0]};
    std::vector<bool> taken(n, false);
    taken[subset[0]] = true;
    for (int i = 1; i < K; ++i) {
      const int pick = WidestLinkFrom(cm, chain.back(), subset, taken);
      if (pick < 0) break;
      taken[pick] = true;
      chain.push_back(pick);
    }
    if (static_cast<int>(chain.size()) == K && chain != subset) orders.push_back(chain);
    for (const auto& order : orders) {
      Candidate c = CutOrder(cm, order, ratio);
      if (c.cost < best.cost) best = c;
    }
  }
  // Chains that need not start at the fastest site nor stay among the K fastest: from each of the
  // fastest few sites, along the widest link to any unused site; every prefix up to a bounded depth is
  // cut. They find pipelines of slower sites joined by fast links when the fast sites' links are slow,
  // which the sets above miss and single local-search moves cannot reach from them.
  constexpr int kChainStarts = 8, kChainDepth = 16;
  std::vector<int> all(n);
  std::iota(all.begin(), all.end(), 0);
  Candidate best_chain;
  for (int i = 0; i < std::min(n, kChainStarts); ++i) {
    std::vector<int> chain = {by_speed[i]};
    std::vector<bool> taken(n, false);
    taken[by_speed[i]] = true;
    while (static_cast<int>(chain.size()) < std::min({n, N, kChainDepth})) {
      const int pick = WidestLinkFrom(cm, chain.back(), all, taken);
      if (pick < 0) break;
      taken[pick] = true;
      chain.push_back(pick);
      Candidate c = CutOrder(cm, chain, ratio);
      if (c.cost < best_chain.cost) best_chain = c;
    }
  }
  // Local search from both starts: from the better one alone it may settle in a worse local optimum than
  // the other start reaches (measured on the random instances of planner_test).
  Candidate a = LocalSearch(cm, ratio, best), b = LocalSearch(cm, ratio, best_chain);
  return b.cost < a.cost ? b : a;
}

std::string SiteList(const ClusterProfile& p, const std::vector<int>& s) {
  std::vector<std::string> names;
  for (int i : s) names.push_back(p.sites[i].name);
  return absl::StrJoin(names, "+");
}

}  // namespace

void PinLayout(const std::vector<std::vector<int>>& sites, const std::vector<int>& last_ops, PlanOptions* o,
               const std::vector<std::vector<int>>& shares) {
  o->fixed_sites.clear();
  o->fixed_replicas.clear();
  o->fixed_shares = shares;
  o->fixed_last_ops = last_ops;
  for (const auto& R : sites) {
    o->fixed_sites.push_back(R.empty() ? -1 : R[0]);
    o->fixed_replicas.emplace_back(R.empty() ? R.end() : R.begin() + 1, R.end());
  }
}

std::vector<int> EvenCuts(int ops, int stages) {
  std::vector<int> last;
  int end = -1;
  for (int k = 0; k < stages; ++k) {
    end += ops / stages + (k < ops % stages ? 1 : 0);
    last.push_back(end);
  }
  return last;
}

std::vector<int> ShareMicroBatches(int micro_batches, const std::vector<double>& seconds) {
  const int r = static_cast<int>(seconds.size());
  std::vector<double> rate(r, 1.0);
  bool all_zero = true;
  for (double s : seconds) all_zero &= s <= 0;
  if (!all_zero)
    for (int i = 0; i < r; ++i) rate[i] = seconds[i] > 0 ? 1.0 / seconds[i] : 0.0;
  const double total = std::accumulate(rate.begin(), rate.end(), 0.0);
  std::vector<int> counts(r, 0);
  std::vector<std::pair<double, int>> remainder;  // (-fraction, index): largest first, earlier on ties
  int given = 0;
  for (int i = 0; i < r; ++i) {
    const double exact = total > 0 ? micro_batches * rate[i] / total : 0.0;
    counts[i] = static_cast<int>(std::floor(exact));
    given += counts[i];
    remainder.push_back({-(exact - counts[i]), i});
  }
  std::sort(remainder.begin(), remainder.end());
  for (int j = 0; given < micro_batches; ++j, ++given) ++counts[remainder[j % r].second];
  return counts;
}

bool WholePipelineReplicas(const std::vector<StagePlan>& stages) {
  if (stages.size() < 2 || stages[0].sites.size() < 2) return false;
  for (const StagePlan& st : stages)
    if (st.sites.size() != stages[0].sites.size() || st.micro_batches != stages[0].micro_batches) return false;
  return true;
}

std::vector<int> MicroBatchOwners(const std::vector<int>& counts) {
  const int total = std::accumulate(counts.begin(), counts.end(), 0);
  std::vector<int> owner, current(counts.size(), 0);
  for (int m = 0; m < total; ++m) {
    int pick = -1;
    for (size_t i = 0; i < counts.size(); ++i) {
      current[i] += counts[i];
      if (counts[i] > 0 && (pick < 0 || current[i] > current[pick])) pick = static_cast<int>(i);
    }
    current[pick] -= total;
    owner.push_back(pick);
  }
  return owner;
}

absl::StatusOr<std::vector<PinnedStage>> ParsePlanLayout(const std::string& text, const std::string& path) {
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  if (!j.contains("stages") || !j["stages"].is_array() || j["stages"].empty())
    return absl::InvalidArgumentError(absl::StrCat(path, ": stages: expected a non-empty list"));
  std::vector<PinnedStage> out;
  std::set<std::string> seen;
  for (size_t k = 0; k < j["stages"].size(); ++k) {
    const auto& st = j["stages"][k];
    const std::string where = absl::StrCat(path, ": stages[", k, "]");
    PinnedStage p;
    if (!st.is_object() || !st.contains("sites") || !st["sites"].is_array() || st["sites"].empty())
      return absl::InvalidArgumentError(absl::StrCat(where, ".sites: expected a non-empty list of site names"));
    for (const auto& site : st["sites"]) {
      if (!site.is_string()) return absl::InvalidArgumentError(absl::StrCat(where, ".sites: expected site names"));
      if (!seen.insert(site.get<std::string>()).second)
        return absl::InvalidArgumentError(
            absl::StrCat(where, ".sites: site '", site.get<std::string>(), "' appears in more than one place"));
      p.sites.push_back(site.get<std::string>());
    }
    if (!st.contains("last_op") || !st["last_op"].is_number_integer() || st["last_op"].get<int64_t>() < 0 ||
        st["last_op"].get<int64_t>() > (1 << 24))
      return absl::InvalidArgumentError(absl::StrCat(where, ".last_op: expected a non-negative integer"));
    p.last_op = st["last_op"].get<int>();
    if (st.contains("micro_batches") && p.sites.size() > 1) {  // a lone site runs them all
      const auto& mb = st["micro_batches"];
      if (!mb.is_array() || mb.size() != p.sites.size())
        return absl::InvalidArgumentError(
            absl::StrCat(where, ".micro_batches: expected one count per site (", p.sites.size(), ")"));
      for (const auto& m : mb) {
        if (!m.is_number_integer() || m.get<int64_t>() < 0 || m.get<int64_t>() > (1 << 24))
          return absl::InvalidArgumentError(absl::StrCat(where, ".micro_batches: expected non-negative integers"));
        p.micro_batches.push_back(m.get<int>());
      }
    }
    if (!out.empty() && p.last_op <= out.back().last_op)
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".last_op: ", p.last_op, " does not follow the previous stage's ", out.back().last_op));
    out.push_back(std::move(p));
  }
  return out;
}

namespace {

// A codec of compression/'s menus as the cost model prices it: its payload per float32 input byte.
Codec Priced(const compression::CodecSpec& spec) {
  return {spec.ShortString(), compression::PayloadRatio(spec, core::DType::kFloat32)};
}

}  // namespace

absl::StatusOr<Codec> PriceCodec(const std::string& codec) {
  auto spec = compression::CodecSpec::Parse(codec);
  if (!spec.ok()) return spec.status();
  Codec c = Priced(*spec);
  // The gradients behind an activation codec travel in compression::GradientCodecBehind's codec.
  if (const std::string behind = compression::GradientCodecBehind(codec); behind != codec)
    if (auto b = compression::CodecSpec::Parse(behind); b.ok()) c.gradient_ratio = Priced(*b).ratio;
  return c;
}

SyncModel SyncModelOf(const core::SyncSpec& spec) {
  SyncModel m;
  m.diloco = spec.mode == core::SyncMode::kDiloco;
  m.inner_steps = spec.inner_steps;
  m.fragments = spec.fragments;
  m.overlap = spec.overlap;
  if (auto codec = PriceCodec(spec.codec); codec.ok()) m.codec = *codec;
  if (spec.sparseloco()) m.UseSparseSum().IgnoreError();  // validated: a top-k codec
  return m;
}

absl::Status SyncModel::UseSparseSum() {
  auto spec = compression::CodecSpec::Parse(codec.name);
  if (!spec.ok() || spec->kind != compression::CodecKind::kTopK)
    return absl::InvalidArgumentError(absl::StrCat("a sparse sum needs a top-k codec, not '", codec.name, "'"));
  sparse_sum = true;
  return absl::OkStatus();
}

std::vector<Codec> DefaultLinkCodecs(double revisit_fraction) {
  std::vector<Codec> menu;
  for (const compression::CodecSpec& spec : compression::ActivationMenu()) menu.push_back(Priced(spec));
  const double int8 = Priced(*compression::CodecSpec::Parse("int8")).ratio;
  const double int4 = Priced(*compression::CodecSpec::Parse("int4")).ratio;
  const double f = std::clamp(revisit_fraction, 0.0, 1.0);
  // int2-delta is not on the menu: its loss cost depends on how far the model moves between a sequence's
  // visits (+1.4% of identity's loss after 200 steps when sequences came back every 9 steps, +30% after 300
  // when they came back every 24, on a smaller model: docs/cost-model.md). It stays available through
  // compression.policy: fixed.
  if (f > 0) {
    // int4-delta takes plain int4's place: where sequences come back, it trained closer to identity in
    // every setting measured (+0.2% against +0.4%; over four seeds +1.2% against +6.2%), and plain int4's
    // cost grows as the model moves between visits. What the trade costs is int4-delta's first visits,
    // which go as int8: (1 - f) x (int8 - int4) more bytes than int4 on average (docs/cost-model.md). Plain
    // int4 stays available through compression.policy: fixed, and on the menu where nothing comes back.
    const std::string delta = "int4-delta";
    const double gradients = Priced(*compression::CodecSpec::Parse(compression::GradientCodecBehind(delta))).ratio;
    auto plain = std::find_if(menu.begin(), menu.end(), [](const Codec& c) { return c.name == "int4"; });
    MERIDIAN_CHECK(plain != menu.end(), "compression::ActivationMenu() offers int4");
    // Its place keeps the menu lightest first: int4-delta's expected ratio lies between int8's and int4's.
    *plain = {delta, (1 - f) * int8 + f * int4, gradients};
  }
  return menu;
}

std::vector<Codec> DefaultGradientCodecs() {
  // compression/'s gradient menu without top-k: with AdamW, top-1% (error feedback) left the loss twice
  // the exact run's after 30 steps and top-10% 7% above it (within 1% only after 200 steps), while int8
  // stayed within 0.1% (docs/cost-model.md). Top-k stays available through compression.policy: fixed.
  std::vector<Codec> menu;
  for (const compression::CodecSpec& spec : compression::GradientMenu())
    if (spec.kind != compression::CodecKind::kTopK) menu.push_back(Priced(spec));
  return menu;
}

double ReferenceStepTime(const OpGraph& graph, const ClusterProfile& profile, int micro_batches, double ratio,
                         const std::vector<int>& sites, const std::vector<int>& last_ops) {
  CostModel cm(graph, profile, micro_batches);  // no recomputation: the reference model
  if (sites.empty() || sites.size() != last_ops.size() || last_ops.back() != cm.ops() - 1) return kInf;
  return SearchCost(cm, sites, last_ops, ratio);
}

// Adds sites unused by `layout`, one at a time, as a replica of the stage where it lowers the predicted
// step time most, while any does; `ev` is kept as the layout's evaluation. Beyond exact_max_sites sites,
// each round tries the kReplicaCandidates fastest unused sites (by whole-model time) rather than all of
// them, so that hundreds of sites plan in seconds.
void ReplicateGreedily(const CostModel& cm, const PlanOptions& o, const OpGraph& graph, Layout* layout,
                       Evaluation* ev) {
  constexpr int kReplicaCandidates = 8;
  const int n = cm.sites();
  std::vector<bool> used(n, false);
  for (const auto& R : layout->sites)
    for (int s : R) used[s] = true;
  std::vector<int> by_speed(n);
  std::iota(by_speed.begin(), by_speed.end(), 0);
  std::stable_sort(by_speed.begin(), by_speed.end(),
                   [&](int a, int b) { return cm.WholeModelTime(a) < cm.WholeModelTime(b); });
  const int limit = n > o.exact_max_sites ? kReplicaCandidates : n;
  while (true) {
    double best_total = ev->total;
    Layout best_layout;
    int tried = 0;
    for (int s : by_speed) {
      if (used[s]) continue;
      if (tried++ == limit) break;
      for (size_t k = 0; k < layout->sites.size(); ++k) {
        Layout trial = *layout;
        trial.sites[k].push_back(s);
        Evaluation te = Evaluate(cm, trial, o, graph);
        if (te.total < best_total * (1 - 1e-9)) best_total = te.total, best_layout = trial;
      }
    }
    if (!(best_total < ev->total * (1 - 1e-9))) return;
    *layout = best_layout;
    for (const auto& R : layout->sites)
      for (int s : R) used[s] = true;
    *ev = Evaluate(cm, *layout, o, graph);
  }
}

// Up to this many sites in a grouping, GroupPipelines tries every grouping of them into pipelines and
// every order of each ((P S)! / P! of them: 360 for two pipelines of three sites).
constexpr int kExactGroupSites = 6;
constexpr int kMaxPipelines = 32;

// The best whole-pipeline layout of the pipelines `grid` (grid[r] = pipeline r's sites, stage by stage),
// cut as one of them cuts best alone (CutOrder of each), by the formula (Evaluate); total kInf when none
// fits.
std::pair<Layout, Evaluation> CutPipelines(const CostModel& cm, const PlanOptions& o, const OpGraph& graph,
                                           double ratio, const std::vector<std::vector<int>>& grid) {
  std::pair<Layout, Evaluation> best;
  // Beyond the exact search's size, the cuts of the first and the last pipeline only (the fastest sites'
  // and the slowest's).
  const bool few = cm.sites() <= o.exact_max_sites;
  for (size_t r = 0; r < grid.size(); ++r) {
    if (!few && r != 0 && r + 1 != grid.size()) continue;
    const std::vector<int>& pipeline = grid[r];
    const Candidate c = CutOrder(cm, pipeline, ratio);
    if (c.cost == kInf || c.last.size() != pipeline.size()) continue;
    Layout trial;
    trial.pipelines = true;
    trial.last = c.last;
    trial.sites.assign(pipeline.size(), {});
    for (const auto& p : grid)
      for (size_t k = 0; k < p.size(); ++k) trial.sites[k].push_back(p[k]);
    Evaluation te = Evaluate(cm, trial, o, graph);
    if (te.total < best.second.total) best = {std::move(trial), std::move(te)};
  }
  return best;
}

// DiLoCo's whole-pipeline replicas, searched (docs/sync.md): for each number of pipelines P >= 2 and of
// stages S with P S sites at most (beyond the exact search's size: at most kMaxPipelines pipelines, and
// P and S on a geometric grid), the fastest P S sites are grouped into P pipelines of S sites --
// every grouping and every order within each when P S <= kExactGroupSites; beyond, two groupings:
// pipelines grown from the fastest free site along the widest links, and stage k's replicas the k-th P
// fastest sites -- and each grouping cut as its best-cutting pipeline alone (CutPipelines). Evaluate
// prices them as the executors run them: every stage shares the micro-batches alike (Layout::pipelines),
// each micro-batch's links only between its own pipeline's sites (LinkPairs), the replicas' sync as its
// bytes once every H steps, overlapped (SyncModel). Returns, for each (P, S) with a feasible grouping,
// the best by the formula with its evaluation.
std::vector<std::pair<Layout, Evaluation>> GroupPipelines(const CostModel& cm, const PlanOptions& o,
                                                          const OpGraph& graph, double ratio) {
  std::vector<std::pair<Layout, Evaluation>> out;
  const int n = cm.sites(), N = cm.ops();
  std::vector<int> by_speed(n);
  std::iota(by_speed.begin(), by_speed.end(), 0);
  std::stable_sort(by_speed.begin(), by_speed.end(),
                   [&](int a, int b) { return cm.WholeModelTime(a) < cm.WholeModelTime(b); });
  // Beyond the exact search's size, P and S on a geometric grid (1, 2, 3, 4, 6, 8, 12, 16, ...): hundreds
  // of sites then plan in seconds, not minutes.
  const bool few = n <= o.exact_max_sites;
  auto next = [&](int x) { return few || x < 4 ? x + 1 : (x & (x - 1)) == 0 ? x + x / 2 : x / 3 * 4; };
  const int max_pipelines = few ? n : std::min(n, kMaxPipelines);
  for (int P = 2; P <= max_pipelines; P = next(P))
    for (int S = 1; S <= std::min(n / P, N); S = next(S)) {
      const std::vector<int> chosen(by_speed.begin(), by_speed.begin() + P * S);
      std::pair<Layout, Evaluation> best;
      auto grid_of = [&](const std::vector<int>& flat) {  // pipeline r = flat[r S .. r S + S)
        std::vector<std::vector<int>> grid(P);
        for (int r = 0; r < P; ++r) grid[r].assign(flat.begin() + r * S, flat.begin() + (r + 1) * S);
        return grid;
      };
      auto take = [&](std::pair<Layout, Evaluation> c) {
        if (c.second.total < best.second.total * (1 - 1e-12)) best = std::move(c);
      };
      if (P * S <= kExactGroupSites) {
        std::vector<int> flat = chosen;
        std::sort(flat.begin(), flat.end());
        do {
          bool canonical = true;  // the pipelines in the order of their first sites: each grouping once
          for (int r = 1; r < P && canonical; ++r) canonical = flat[(r - 1) * S] < flat[r * S];
          if (canonical) take(CutPipelines(cm, o, graph, ratio, grid_of(flat)));
        } while (std::next_permutation(flat.begin(), flat.end()));
      } else {
        // Along the widest links: each pipeline from the fastest free site.
        std::vector<bool> taken(n, true);
        for (int s : chosen) taken[s] = false;
        std::vector<int> flat;
        for (int r = 0; r < P; ++r) {
          int from = -1;
          for (int s : chosen)
            if (!taken[s]) {
              from = s;
              break;
            }
          for (int k = 0; k < S && from >= 0; ++k) {
            flat.push_back(from);
            taken[from] = true;
            if (k + 1 < S) from = WidestLinkFrom(cm, from, chosen, taken);
          }
        }
        if (static_cast<int>(flat.size()) == P * S) take(CutPipelines(cm, o, graph, ratio, grid_of(flat)));
        // By speed: stage k's replicas the k-th P fastest, pipeline r the r-th of each.
        std::vector<int> tiers;
        for (int r = 0; r < P; ++r)
          for (int k = 0; k < S; ++k) tiers.push_back(chosen[k * P + r]);
        take(CutPipelines(cm, o, graph, ratio, grid_of(tiers)));
      }
      if (best.second.total < kInf) out.push_back(std::move(best));
    }
  return out;
}

absl::StatusOr<Plan> PlanPipeline(const OpGraph& graph, const ClusterProfile& profile, const PlanOptions& o) {
  if (o.micro_batches < 1) return absl::InvalidArgumentError("micro_batches must be at least 1");
  if (!(o.ratio > 0 && o.ratio <= 1)) return absl::InvalidArgumentError("the compression ratio must be in (0, 1]");
  if (graph.ops.empty()) return absl::InvalidArgumentError("the operator graph has no ops");
  if (profile.sites.empty()) return absl::InvalidArgumentError("the profile has no sites");
  if (o.adaptive_compression && (o.link_codecs.empty() || o.gradient_codecs.empty()))
    return absl::InvalidArgumentError("adaptive compression needs a non-empty codec menu");
  std::map<std::string, int> op_index;
  for (size_t i = 0; i < graph.ops.size(); ++i) op_index[graph.ops[i].name] = static_cast<int>(i);
  for (const auto& s : profile.sites)
    for (const auto& [name, secs] : s.op_seconds)
      if (!op_index.count(name))
        return absl::InvalidArgumentError(
            absl::StrCat("profile: sites '", s.name, "'.op_seconds names op '", name, "', which the graph lacks"));

  CostModel cm(graph, profile, o.micro_batches, o.deep_pipeline, o.zero, o.recompute, o.gradient_bytes_fraction);
  cm.set_step_overlap(o.step_overlap);
  const int n = cm.sites(), N = cm.ops();
  const double ratio = SearchRatio(o);
  Plan plan;
  plan.micro_batches = o.micro_batches;

  Candidate best;
  std::vector<Candidate> alternatives;  // the exact search's best pipeline for each number of stages
  if (!o.fixed_sites.empty() || !o.fixed_last_ops.empty()) {
    const size_t S = o.fixed_sites.size();
    if (S != o.fixed_last_ops.size())
      return absl::InvalidArgumentError("a fixed layout needs as many stage ends as sites");
    std::vector<bool> seen(n, false);
    for (size_t k = 0; k < S; ++k) {
      const int s = o.fixed_sites[k], last = o.fixed_last_ops[k];
      if (s < 0 || s >= n || seen[s])
        return absl::InvalidArgumentError("a fixed layout names a site twice or out of range");
      seen[s] = true;
      if (last < (k ? o.fixed_last_ops[k - 1] + 1 : 0) || last >= N || (k + 1 == S && last != N - 1))
        return absl::InvalidArgumentError("a fixed layout's stage ends must increase and end at the graph's last op");
      if (const int tied = k + 1 < S ? CutSeparatesTiedOps(graph, last) : -1; tied >= 0)
        return absl::InvalidArgumentError(
            absl::StrCat("a fixed layout's stage ", k + 1, " ends at op '", graph.ops[last].name,
                         "', which separates '", graph.ops[tied].name,
                         "' from an op that uses its weights (tied embeddings): the two must run in one stage"));
    }
    if (o.fixed_replicas.size() > S)
      return absl::InvalidArgumentError("fixed replicas for more stages than the layout has");
    if (o.fixed_shares.size() > S)
      return absl::InvalidArgumentError("fixed micro-batch shares for more stages than the layout has");
    for (size_t k = 0; k < o.fixed_shares.size(); ++k) {
      const auto& share = o.fixed_shares[k];
      if (share.empty()) continue;
      const size_t sites = 1 + (k < o.fixed_replicas.size() ? o.fixed_replicas[k].size() : 0);
      int sum = 0;
      for (int m : share) sum += m < 0 ? o.micro_batches + 1 : m;
      if (share.size() != sites || sum != o.micro_batches)
        return absl::InvalidArgumentError(absl::StrCat("stage ", k + 1, "'s fixed micro-batch shares (",
                                                       absl::StrJoin(share, "/"), ") must give each of its ", sites,
                                                       " site(s) a count, summing to ", o.micro_batches));
    }
    for (const auto& R : o.fixed_replicas)
      for (int s : R) {
        if (s < 0 || s >= n || seen[s])
          return absl::InvalidArgumentError("a fixed layout names a site twice or out of range");
        seen[s] = true;
      }
    if (static_cast<int>(S) > cm.overlap_depth_cap())
      return absl::FailedPreconditionError(
          absl::StrCat("the fixed layout's ", S, " stages need 1F1B's ", S,
                       " micro-batches in flight at the first, and ", "job.step_overlap ", o.step_overlap, " with ",
                       o.micro_batches, " micro-batches a step allows at most ", cm.overlap_depth_cap()));
    best = {SearchCost(cm, o.fixed_sites, o.fixed_last_ops, ratio), o.fixed_sites, o.fixed_last_ops};
    if (best.cost == kInf)
      return absl::FailedPreconditionError(
          "the fixed layout is infeasible: a stage exceeds its site's memory or "
          "two neighbouring sites have no link");
    plan.method = "fixed";
    plan.notes.push_back("fixed layout given by the caller (no search)");
  } else {
    best = Heuristic(cm, ratio);
    plan.method = "heuristic";
  }
  if (plan.method != "fixed" && !o.force_heuristic && n <= o.exact_max_sites) {
    // With deep_pipeline the simulated step decides between the best pipelines of each number of stages,
    // so those within half again of the best formula are kept too.
    double ub = best.cost == kInf ? kInf : best.cost * (o.deep_pipeline ? 1.5 : 1.0);
    ExactResult ex = ExactSearch(cm, ratio, ub, o.exact_work_limit);
    if (ex.complete) {
      plan.method = "exact";
      if (ex.best < best.cost || best.cost == kInf) best = {ex.best, ex.order, ex.last};
      for (const auto& c : ex.by_stages) alternatives.push_back({c.cost, c.order, c.last});
      plan.notes.push_back(absl::StrFormat(
          "exact search over every order of every subset of the %d sites and every cut (%.3g transitions)", n,
          ex.transitions));
    } else {
      plan.notes.push_back(
          absl::StrFormat("exact search stopped after %.3g transitions (limit %.3g); this is the heuristic's plan",
                          ex.transitions, o.exact_work_limit));
    }
  } else if (plan.method != "fixed") {
    plan.notes.push_back(absl::StrFormat(
        "heuristic search (%d sites > %d for exact search): K fastest sites for each K, ordered by speed or "
        "along the widest links, and widest-link chains from the fastest sites; cuts by bottleneck bisection "
        "and local moves",
        n, o.exact_max_sites));
  }
  if (best.cost == kInf) {
    // Explain what does not fit: the model's state alone against the largest site.
    double state = 0, acts = 0;
    for (const auto& op : graph.ops) state += op.param_bytes + op.optimizer_bytes, acts += SavedBytes(op);
    double total_mem = 0, largest = 0;
    std::string largest_name;
    for (const auto& s : profile.sites) {
      total_mem += s.memory_bytes;
      if (s.memory_bytes > largest) largest = s.memory_bytes, largest_name = s.name;
    }
    std::string why;
    for (int i = 0; i < N; ++i) {
      const Op& op = graph.ops[i];
      double need = op.param_bytes + op.optimizer_bytes + SavedBytes(op);
      if (need > largest) {
        why = absl::StrFormat("op '%s' alone needs %.3g bytes, more than the largest site ('%s', %.3g bytes)", op.name,
                              need, largest_name, largest);
        break;
      }
    }
    if (why.empty() && state + acts > total_mem)
      why = absl::StrFormat(
          "the model needs at least %.3g bytes (weights, gradients, optimizer state and one "
          "micro-batch of activations) but all %d sites together have %.3g bytes",
          state + acts, n, total_mem);
    if (why.empty())
      why =
          "no chain of linked sites can hold the model (check the profile's links: sites without a link in "
          "both directions cannot be neighbours) and its memory";
    return absl::FailedPreconditionError(absl::StrCat("no feasible plan: ", why));
  }

  Layout layout;
  for (int s : best.order) layout.sites.push_back({s});
  layout.last = best.last;
  if (plan.method == "fixed")
    for (size_t k = 0; k < o.fixed_replicas.size(); ++k)
      for (int s : o.fixed_replicas[k]) layout.sites[k].push_back(s);
  Evaluation ev = Evaluate(cm, layout, o, graph);
  if (ev.total == kInf)
    return absl::FailedPreconditionError(
        "the fixed layout is infeasible: a replica exceeds its site's memory or two "
        "of a stage's sites have no link");

  // Replication: greedily add unused sites as replicas where they help most. The best pure pipeline may
  // use every site, so shallower pipelines on the fastest sites are tried too, each with its replicas.
  // What a layout is predicted to take: the simulated schedule with deep_pipeline, else the formula.
  auto predicted = [&](const Layout& L, const Evaluation& e) {
    return o.deep_pipeline ? SimulateLayout(cm, L, e, o, graph).total : e.total;
  };
  // Every layout compared below, with its prediction (Plan::candidates).
  std::vector<PlanCandidate> considered;
  auto consider = [&](const Layout& L, const Evaluation& e, double x) {
    if (x < kInf) considered.push_back({L.sites, L.last, x, L.pipelines ? e.shares : std::vector<std::vector<int>>{}});
  };
  double current = predicted(layout, ev);  // the prediction for `layout` as it stands
  consider(layout, ev, current);
  size_t formula_stages = layout.sites.size();  // the formula's best pipeline, before any simulation
  size_t simulated_stages = formula_stages;     // the pipeline the simulation preferred among those
  if (o.deep_pipeline && alternatives.size() > 1) {
    // The formula assumes every round trip covered; with few micro-batches a step's fill and drain carry
    // the latencies, so a pipeline of fewer (or more) stages may simulate faster.
    const size_t stages_before = layout.sites.size();
    for (const Candidate& c : alternatives) {
      Layout trial;
      for (int site : c.order) trial.sites.push_back({site});
      trial.last = c.last;
      Evaluation te = Evaluate(cm, trial, o, graph);
      const double x = predicted(trial, te);
      consider(trial, te, x);
      if (x < current * (1 - 1e-9)) layout = trial, ev = te, current = x;
    }
    formula_stages = stages_before;
    simulated_stages = layout.sites.size();
  }
  if (o.replication && plan.method != "fixed") {
    const double pipeline_total = current;
    const size_t pipeline_stages = layout.sites.size();
    ReplicateGreedily(cm, o, graph, &layout, &ev);
    current = predicted(layout, ev);
    consider(layout, ev, current);
    std::vector<int> by_speed(n);
    std::iota(by_speed.begin(), by_speed.end(), 0);
    std::stable_sort(by_speed.begin(), by_speed.end(),
                     [&](int a, int b) { return cm.WholeModelTime(a) < cm.WholeModelTime(b); });
    for (int K = 1; K < std::min({n, N + 1, 17}); ++K) {
      Candidate c = CutOrder(cm, std::vector<int>(by_speed.begin(), by_speed.begin() + K), ratio);
      if (c.cost == kInf) continue;
      Layout trial;
      for (int site : c.order) trial.sites.push_back({site});
      trial.last = c.last;
      Evaluation te = Evaluate(cm, trial, o, graph);
      ReplicateGreedily(cm, o, graph, &trial, &te);
      const double x = predicted(trial, te);
      consider(trial, te, x);
      if (x < current * (1 - 1e-9)) layout = trial, ev = te, current = x;
    }
    // DiLoCo: whole pipelines, grouped and cut by their own search.
    if (o.sync.diloco) {
      const double before = current;
      bool grouped = false;
      // The formula ranks the groupings of each (P, S); the three best are predicted (simulated).
      std::vector<std::pair<Layout, Evaluation>> groupings = GroupPipelines(cm, o, graph, ratio);
      std::stable_sort(groupings.begin(), groupings.end(),
                       [](const auto& a, const auto& b) { return a.second.total < b.second.total; });
      if (groupings.size() > 3) groupings.resize(3);
      for (auto& [trial, te] : groupings) {
        const double x = predicted(trial, te);
        consider(trial, te, x);
        if (x < current * (1 - 1e-9)) layout = trial, ev = te, current = x, grouped = true;
      }
      if (grouped) {
        std::vector<std::string> pipelines;
        for (size_t r = 0; r < layout.sites[0].size(); ++r) {
          std::vector<std::string> names;
          for (const auto& R : layout.sites) names.push_back(profile.sites[R[r]].name);
          pipelines.push_back(absl::StrJoin(names, " -> "));
        }
        plan.notes.push_back(absl::StrFormat(
            "%d whole DiLoCo pipelines (%s), each of %d stage(s), its micro-batches within its own sites: "
            "predicted %.4g s per step against %.4g s for the best layout otherwise",
            layout.sites[0].size(), absl::StrJoin(pipelines, "; "), layout.sites.size(), current, before));
      }
    }
    int replicas = 0;
    for (const auto& R : layout.sites) replicas += static_cast<int>(R.size()) - 1;
    if (replicas > 0)
      plan.notes.push_back(absl::StrFormat(
          "%d stage(s) with %d replica site(s): predicted %.4g s per step against %.4g s for the best pipeline "
          "without replicas (%d stage(s))",
          layout.sites.size(), replicas, current, pipeline_total, pipeline_stages));
  }
  if (o.deep_pipeline && simulated_stages != formula_stages && layout.sites.size() == simulated_stages)
    plan.notes.push_back(absl::StrFormat(
        "%d stage(s) rather than the formula's best pipeline of %d: the simulated schedule (fill, drain and "
        "latencies with %d micro-batches) is shorter",
        layout.sites.size(), formula_stages, o.micro_batches));
  SimulatedLayout sim;
  if (o.deep_pipeline && o.adaptive_compression)
    ChooseLinkCodecsBySimulation(cm, layout, o, graph, &ev, &sim);
  else if (o.deep_pipeline)
    sim = SimulateLayout(cm, layout, ev, o, graph);

  const int S = static_cast<int>(layout.sites.size());
  for (int k = 0; k < S; ++k) {
    StagePlan st;
    st.sites = layout.sites[k];
    for (int s : st.sites) st.site_names.push_back(profile.sites[s].name);
    st.first_op = k == 0 ? 0 : layout.last[k - 1] + 1;
    st.last_op = layout.last[k];
    st.compute_seconds = ev.t[k];
    if (st.sites.size() == 1) {
      st.micro_batches = {plan.micro_batches};
    } else {
      st.micro_batches = ev.shares[k];  // by speed, pinned, or alike along whole pipelines (Evaluate)
    }
    st.memory_bytes = ev.memory[k];
    st.in_flight = std::min(plan.micro_batches, S - k);
    st.recompute = ev.recompute[k];
    if (o.deep_pipeline) {
      st.in_flight = sim.in_flight[k];
      st.recompute = sim.recompute[k];
      st.memory_bytes = 0;
      for (int s : st.sites)
        st.memory_bytes =
            std::max(st.memory_bytes, cm.SiteMemory(s, st.first_op, st.last_op, st.in_flight, st.recompute));
      st.busy_seconds = sim.step.busy_seconds[k];
      st.wait_seconds = sim.step.wait_seconds[k];
      const auto [forward_codec, backward_codec] = PassCodecSeconds(cm, layout, ev, o, k);
      st.codec_seconds = forward_codec + backward_codec;
      const auto [forward_transport, backward_transport] = PassTransportSeconds(cm, layout, ev, o, k);
      st.transport_seconds = forward_transport + backward_transport;
      st.optimizer_seconds = sim.optimizer[k];
    }
    st.memory_available_bytes = kInf;
    for (int s : st.sites)
      st.memory_available_bytes = std::min(st.memory_available_bytes, profile.sites[s].memory_bytes);
    st.allreduce_seconds = ev.allreduce[k];
    st.site_reduce_seconds = ev.site_reduce.empty() ? 0 : ev.site_reduce[k];
    for (int s : st.sites) st.workers.push_back(std::max(1, profile.sites[s].workers));
    if (st.sites.size() > 1)
      st.gradient_codec = ev.grad_codec[k] >= 0 ? o.gradient_codecs[ev.grad_codec[k]].name : "identity";
    plan.stages.push_back(std::move(st));
  }
  for (int k = 0; k < S; ++k)
    if (ev.recompute[k])
      plan.notes.push_back(absl::StrFormat(
          "stage %d recomputes its activations before each backward pass: without, its memory could not hold "
          "the %d micro-batches 1F1B keeps in flight there",
          k + 1, std::min(plan.micro_batches, S - k)));
  if (o.deep_pipeline && std::find(sim.recompute.begin(), sim.recompute.end(), true) != sim.recompute.end()) {
    PlanOptions without = o;
    without.recompute = false;
    const SimulatedLayout plain = SimulateLayout(cm, layout, ev, without, graph);
    for (int k = 0; k < S; ++k)
      if (sim.recompute[k] && !ev.recompute[k])
        plan.notes.push_back(absl::StrFormat(
            "stage %d recomputes its activations before each backward pass, so that its memory holds %d "
            "micro-batches in flight (%d without): the simulated step is %.4g s, against %.4g s without "
            "recomputation",
            k + 1, sim.in_flight[k], plain.in_flight[k], sim.total, plain.total));
  }
  for (int k = 0; k + 1 < S; ++k) {
    LinkPlan lp;
    lp.from_stage = k;
    lp.bytes = cm.CutBytes(layout.last[k]);
    lp.seconds = ev.c[k];
    if (ev.link_codec[k] >= 0) {
      lp.codec = o.link_codecs[ev.link_codec[k]].name;
      lp.ratio = o.link_codecs[ev.link_codec[k]].ratio;
    } else {
      lp.ratio = o.ratio;
      lp.codec = o.ratio == 1.0 ? "identity" : absl::StrFormat("ratio %.3g", o.ratio);
    }
    plan.links.push_back(lp);
  }
  plan.sync = o.sync;
  plan.zero = o.zero;
  plan.step_overlap = o.step_overlap;
  if (o.step_overlap > 0)
    plan.notes.push_back(absl::StrFormat(
        "job.step_overlap %d: each step's first %d micro-batches begin on the previous step's weights; every stage "
        "keeps at most %d in flight and a second copy of its weights; %s",
        o.step_overlap, o.step_overlap, MaxInFlightForOverlap(o.micro_batches, o.step_overlap),
        o.deep_pipeline ? "the predicted step is a steady overlapped step of the simulated schedule"
                        : "the reference formula's predicted step still counts the step boundary the overlap hides "
                          "(meridian simulate runs it)"));
  std::stable_sort(considered.begin(), considered.end(), [](const PlanCandidate& a, const PlanCandidate& b) {
    return a.predicted_seconds < b.predicted_seconds;
  });
  for (const auto& c : considered)
    if (std::none_of(plan.candidates.begin(), plan.candidates.end(),
                     [&](const PlanCandidate& d) { return d.sites == c.sites && d.last_ops == c.last_ops; }))
      plan.candidates.push_back(c);
  plan.predicted_step_seconds = ev.total;
  plan.fill_drain_seconds = ev.fill;
  plan.steady_seconds = ev.steady;
  plan.sync_seconds = ev.sync;
  plan.formula_step_seconds = ev.total;
  if (o.deep_pipeline) {
    plan.simulated = true;
    plan.predicted_step_seconds = sim.total;
    plan.optimizer_seconds = *std::max_element(sim.optimizer.begin(), sim.optimizer.end());
  }
  plan.compute_bound_seconds = ComputeBoundSeconds(graph, profile, o.micro_batches);

  // The bottleneck: the largest per-micro-batch term.
  double worst = -1;
  for (int k = 0; k < S; ++k)
    if (ev.t[k] + ev.recompute_t[k] > worst)
      worst = ev.t[k] + ev.recompute_t[k],
      plan.bottleneck =
          absl::StrFormat("stage %d compute (%s): %.4g s per micro-batch%s", k + 1, SiteList(profile, layout.sites[k]),
                          worst, ev.recompute[k] ? ", its recomputation included" : "");
  for (int k = 0; k + 1 < S; ++k)
    if (ev.pace[k] > worst)
      worst = ev.pace[k], plan.bottleneck = absl::StrFormat("link %d->%d (%s -> %s): %.4g s per micro-batch", k + 1,
                                                            k + 2, SiteList(profile, layout.sites[k]),
                                                            SiteList(profile, layout.sites[k + 1]), ev.pace[k]);
  std::vector<bool> in_plan(n, false);
  for (const auto& R : layout.sites)
    for (int s : R) in_plan[s] = true;
  for (int s = 0; s < n; ++s)
    if (!in_plan[s])
      plan.notes.push_back(absl::StrFormat("site '%s' is unused: no plan that includes it%s predicts a shorter step",
                                           profile.sites[s].name, o.replication ? " (as a stage or a replica)" : ""));
  for (int k = 0; k + 1 < S; ++k)
    if (ev.link_codec[k] > 0)
      plan.notes.push_back(
          o.deep_pipeline
              ? absl::StrFormat("link %d->%d compressed with %s: lighter codecs would lengthen the simulated step by "
                                "more than 1%%",
                                k + 1, k + 2, plan.links[k].codec)
              : absl::StrFormat("link %d->%d compressed with %s: lighter codecs would make it slower than the slowest "
                                "stage",
                                k + 1, k + 2, plan.links[k].codec));
  if (S > 1 && o.adaptive_compression &&
      std::any_of(o.link_codecs.begin(), o.link_codecs.end(), [](const Codec& c) { return c.name == "int4-delta"; }) &&
      std::none_of(o.link_codecs.begin(), o.link_codecs.end(), [](const Codec& c) { return c.name == "int4"; }))
    plan.notes.push_back(
        "the run revisits its sequences: int4-delta is offered instead of plain int4, which trains further from "
        "identity's loss (docs/cost-model.md); compression.policy: fixed still offers int4");
  return plan;
}

double StagePassSeconds(const OpGraph& graph, const SiteProfile& site, const StagePlan& stage) {
  return RangeSeconds(graph, site, stage.first_op, stage.last_op) *
         ComputeFactor(graph, stage.first_op, stage.last_op, stage.recompute);
}

double ExchangeSeconds(const OpGraph& graph, const ClusterProfile& profile, const SyncModel& sync,
                       const StagePlan& stage, double gradient_bytes_fraction) {
  const int r = static_cast<int>(stage.site_names.size());
  if (r < 2) return 0;
  std::map<std::pair<std::string, std::string>, const LinkProfile*> links;
  for (const auto& l : profile.links) links[{l.from, l.to}] = &l;
  double inv_bw = 0, max_lat = 0;
  for (const auto& u : stage.site_names) {
    double sum = 0;
    for (const auto& v : stage.site_names) {
      if (u == v) continue;
      auto l = links.find({u, v});
      if (l == links.end() || !(l->second->bandwidth_bytes_per_second > 0)) return kInf;
      sum += 1.0 / l->second->bandwidth_bytes_per_second;
      max_lat = std::max(max_lat, l->second->latency_seconds);
    }
    inv_bw = std::max(inv_bw, sum);
  }
  const double grad = GradientBytes(graph, stage.first_op, stage.last_op, gradient_bytes_fraction);
  return ReplicaExchangeSeconds(grad, r, inv_bw, max_lat, sync.codec.ratio, sync.sparse_sum);
}

std::string PlanTable(const Plan& plan, const OpGraph& graph, const ClusterProfile& profile) {
  std::string out;
  out += absl::StrFormat(
      "Plan: %d stage(s) over %d of %d site(s), %d micro-batches, %s search\n\n", plan.stages.size(),
      [&] {
        int c = 0;
        for (const auto& s : plan.stages) c += static_cast<int>(s.sites.size());
        return c;
      }(),
      profile.sites.size(), plan.micro_batches, plan.method);
  out += absl::StrFormat("%-5s %-22s %-34s %11s %22s %23s\n", "stage", "sites", "ops", "compute/mb", "link to next /mb",
                         "memory used / avail");
  auto gib = [](double b) { return b / (1024.0 * 1024 * 1024); };
  for (size_t k = 0; k < plan.stages.size(); ++k) {
    const StagePlan& s = plan.stages[k];
    std::string ops =
        absl::StrFormat("%d-%d %s..%s", s.first_op, s.last_op, graph.ops[s.first_op].name, graph.ops[s.last_op].name);
    if (ops.size() > 34) ops = ops.substr(0, 31) + "...";
    std::string link = "-";
    if (k < plan.links.size()) link = absl::StrFormat("%.4g s %s", plan.links[k].seconds, plan.links[k].codec);
    // A site of several devices shows its worker count: "b x2".
    std::vector<std::string> names;
    for (size_t i = 0; i < s.site_names.size(); ++i)
      names.push_back(i < s.workers.size() && s.workers[i] > 1 ? absl::StrCat(s.site_names[i], " x", s.workers[i])
                                                               : s.site_names[i]);
    out += absl::StrFormat("%-5d %-22s %-34s %9.4g s %22s %9.2f / %7.2f GiB\n", k + 1, absl::StrJoin(names, "+"), ops,
                           s.compute_seconds, link, gib(s.memory_bytes), gib(s.memory_available_bytes));
    for (size_t i = 0; i < s.site_names.size(); ++i)
      if (i < s.workers.size() && s.workers[i] > 1)
        out += absl::StrFormat(
            "      site %s runs %d workers (c10d, rows of every micro-batch split among them): their gradient sum "
            "%.4g s per step%s\n",
            s.site_names[i], s.workers[i], s.site_reduce_seconds,
            plan.zero == 1 ? ", optimizer state sharded (ZeRO-1)" : "");
    if (s.sites.size() > 1 && plan.sync.diloco)
      out += absl::StrFormat(
          "      replicas run %s of the %d micro-batches as DiLoCo workers: %s exchanges every %d steps%s, "
          "%.4g s per step beyond their compute\n",
          absl::StrJoin(s.micro_batches, "/"), plan.micro_batches,
          plan.sync.sparse_sum ? plan.sync.codec.name + " (SparseLoCo: sparse sums)" : plan.sync.codec.name,
          plan.sync.inner_steps, plan.sync.overlap ? " (overlapped)" : "", s.allreduce_seconds);
    else if (s.sites.size() > 1)
      out += absl::StrFormat(
          "      replicas run %s of the %d micro-batches and average gradients (reduce-scatter + all-gather): "
          "%.4g s per step (%s)\n",
          absl::StrJoin(s.micro_batches, "/"), plan.micro_batches, s.allreduce_seconds, s.gradient_codec);
  }
  out += absl::StrFormat("\nbottleneck:            %s\n", plan.bottleneck);
  std::vector<int> depth, depth_1f1b;
  std::vector<std::string> shown;  // "12r": 12 in flight with recomputation
  bool recompute = false;
  for (size_t k = 0; k < plan.stages.size(); ++k) {
    depth.push_back(plan.stages[k].in_flight);
    depth_1f1b.push_back(std::min<int>(plan.micro_batches, static_cast<int>(plan.stages.size() - k)));
    shown.push_back(absl::StrCat(plan.stages[k].in_flight, plan.stages[k].recompute ? "r" : ""));
    recompute = recompute || plan.stages[k].recompute;
  }
  out += absl::StrFormat("in flight per stage:   %s micro-batches%s%s\n", absl::StrJoin(shown, " / "),
                         depth == depth_1f1b ? " (1F1B)"
                                             : absl::StrCat(" (1F1B: ", absl::StrJoin(depth_1f1b, " / "),
                                                            "; deeper where the round trip needs it)"),
                         recompute ? "; r: activations recomputed before each backward pass, to afford the depth" : "");
  const std::string terms =
      absl::StrFormat("fill+drain %.4g s + steady %.4g s%s", plan.fill_drain_seconds, plan.steady_seconds,
                      plan.sync_seconds > 0 ? absl::StrFormat(" + sync %.4g s", plan.sync_seconds) : "");
  if (plan.simulated)
    out += absl::StrFormat(
        "predicted step time:   %.4g s  (simulated schedule%s%s; steady-state formula %.4g s: %s)\n",
        plan.predicted_step_seconds, plan.sync_seconds > 0 ? absl::StrFormat(" + sync %.4g s", plan.sync_seconds) : "",
        plan.optimizer_seconds > 0 ? absl::StrFormat(" + optimizer %.4g s", plan.optimizer_seconds) : "",
        plan.formula_step_seconds, terms);
  else
    out += absl::StrFormat("predicted step time:   %.4g s  (%s)\n", plan.predicted_step_seconds, terms);
  out += absl::StrFormat("compute bound:         %.4g s  (all sites' throughput, no communication)\n",
                         plan.compute_bound_seconds);
  out += absl::StrFormat("efficiency:            %.1f%% of the compute bound\n",
                         100.0 * plan.compute_bound_seconds / plan.predicted_step_seconds);
  for (const auto& n : plan.notes) out += "note: " + n + "\n";
  return out;
}

std::string PlanJson(const Plan& plan, const OpGraph& graph) {
  using json = nlohmann::json;
  json stages = json::array(), links = json::array();
  for (const auto& s : plan.stages) {
    json js = {{"sites", s.site_names},
               {"first_op", s.first_op},
               {"last_op", s.last_op},
               {"first_op_name", graph.ops[s.first_op].name},
               {"last_op_name", graph.ops[s.last_op].name},
               {"compute_seconds", s.compute_seconds},
               {"memory_bytes", s.memory_bytes},
               {"memory_available_bytes", s.memory_available_bytes},
               {"allreduce_seconds", s.allreduce_seconds},
               {"micro_batches", s.micro_batches},
               {"in_flight", s.in_flight},
               {"recompute", s.recompute},
               {"workers", s.workers}};
    if (s.site_reduce_seconds > 0) js["site_reduce_seconds"] = s.site_reduce_seconds;
    if (s.codec_seconds > 0) js["codec_seconds"] = s.codec_seconds;
    if (s.transport_seconds > 0) js["transport_seconds"] = s.transport_seconds;
    if (s.optimizer_seconds > 0) js["optimizer_seconds"] = s.optimizer_seconds;
    if (plan.simulated) js["simulated_busy_seconds"] = s.busy_seconds, js["simulated_wait_seconds"] = s.wait_seconds;
    if (!s.gradient_codec.empty()) js["gradient_codec"] = s.gradient_codec;
    stages.push_back(js);
  }
  for (const auto& l : plan.links)
    links.push_back({{"from_stage", l.from_stage},
                     {"to_stage", l.from_stage + 1},
                     {"bytes", l.bytes},
                     {"seconds", l.seconds},
                     {"codec", l.codec},
                     {"ratio", l.ratio}});
  json j = {{"predicted_step_seconds", plan.predicted_step_seconds},
            {"compute_bound_seconds", plan.compute_bound_seconds},
            {"fill_drain_seconds", plan.fill_drain_seconds},
            {"steady_seconds", plan.steady_seconds},
            {"sync_seconds", plan.sync_seconds},
            {"simulated", plan.simulated},
            {"formula_step_seconds", plan.formula_step_seconds},
            {"optimizer_seconds", plan.optimizer_seconds},
            {"micro_batches", plan.micro_batches},
            {"zero", plan.zero},
            {"step_overlap", plan.step_overlap},
            {"sync", plan.sync.diloco ? json{{"mode", "diloco"},
                                             {"inner_steps", plan.sync.inner_steps},
                                             {"fragments", plan.sync.fragments},
                                             {"overlap", plan.sync.overlap},
                                             {"codec", plan.sync.codec.name},
                                             {"ratio", plan.sync.codec.ratio},
                                             {"sparse_sum", plan.sync.sparse_sum}}
                                      : json{{"mode", "every_step"}}},
            {"method", plan.method},
            {"bottleneck", plan.bottleneck},
            {"stages", stages},
            {"links", links},
            {"notes", plan.notes}};
  return j.dump(2) + "\n";
}

std::string PlanDot(const Plan& plan, const OpGraph& graph) {
  std::string out = "digraph plan {\n  rankdir=LR;\n  node [shape=box, style=rounded];\n";
  out += absl::StrFormat("  label=\"predicted step %.4g s, compute bound %.4g s\";\n", plan.predicted_step_seconds,
                         plan.compute_bound_seconds);
  for (size_t k = 0; k < plan.stages.size(); ++k) {
    const auto& s = plan.stages[k];
    out += absl::StrFormat("  s%d [label=\"stage %d\\n%s\\nops %d-%d (%s..%s)\\n%.4g s/mb\"];\n", k, k + 1,
                           absl::StrJoin(s.site_names, " + "), s.first_op, s.last_op, graph.ops[s.first_op].name,
                           graph.ops[s.last_op].name, s.compute_seconds);
  }
  for (const auto& l : plan.links)
    out += absl::StrFormat("  s%d -> s%d [label=\"%.3g MB, %s\\n%.4g s/mb\"];\n", l.from_stage, l.from_stage + 1,
                           l.bytes / 1e6, l.codec, l.seconds);
  return out + "}\n";
}

}  // namespace meridian::partitioner
