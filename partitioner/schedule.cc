#include "partitioner/schedule.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

namespace meridian::partitioner {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

int DefaultInFlight(const PipelineTimes& t, int k) {
  const int S = static_cast<int>(t.forward_seconds.size());
  return t.in_flight.empty() ? S - k : t.in_flight[k];
}

double RecomputeSeconds(const PipelineTimes& t, int k) {
  return t.recompute_seconds.empty() ? 0.0 : t.recompute_seconds[k];
}

// Stage k's work on its frames per forward and per backward pass (PipelineTimes::forward_frame_seconds).
double FrameSeconds(const PipelineTimes& t, int k, char kind) {
  const std::vector<double>& v = kind == 'F' ? t.forward_frame_seconds : t.backward_frame_seconds;
  return v.empty() ? 0.0 : v[k];
}

// How many replicas run stage k (PipelineTimes::owners; 1 where none are given).
int Replicas(const PipelineTimes& t, int k) {
  if (k >= static_cast<int>(t.owners.size()) || t.owners[k].empty()) return 1;
  return 1 + *std::max_element(t.owners[k].begin(), t.owners[k].end());
}

// Replica r of stage k's pass times over the stage's (PipelineTimes::replica_scale; 1 where none is given).
double ReplicaScale(const PipelineTimes& t, int k, int r) {
  const bool given = Replicas(t, k) > 1 && k < static_cast<int>(t.replica_scale.size()) &&
                     r < static_cast<int>(t.replica_scale[k].size());
  return given ? t.replica_scale[k][r] : 1.0;
}

}  // namespace

int InFlightOf(int stage, int num_stages, int micro_batches, int in_flight) {
  if (in_flight <= 0) in_flight = num_stages - stage;
  return std::max(1, std::min(in_flight, micro_batches));
}

std::vector<std::pair<char, int>> PipelineSchedule(int stage, int num_stages, int micro_batches, int in_flight) {
  in_flight = InFlightOf(stage, num_stages, micro_batches, in_flight);
  const int warmup = std::min(in_flight - 1, micro_batches);
  std::vector<std::pair<char, int>> s;
  s.reserve(2 * static_cast<size_t>(std::max(micro_batches, 0)));
  int f = 0, b = 0;
  for (; f < warmup; ++f) s.push_back({'F', f});
  while (f < micro_batches) {
    s.push_back({'F', f++});
    s.push_back({'B', b++});
  }
  while (b < micro_batches) s.push_back({'B', b++});
  return s;
}

std::vector<StepEntry> OverlappedStepSchedule(int stage, int num_stages, int micro_batches, int in_flight, int k_done,
                                              int k_next) {
  const int M = micro_batches;
  // The step's part of the sequence of its M micro-batches and the next step's first k: through its last
  // entry of this step or forward pass of the next.
  auto part = [&](int k) {
    std::vector<std::pair<char, int>> v = PipelineSchedule(stage, num_stages, M + k, in_flight);
    size_t end = 0;
    for (size_t i = 0; i < v.size(); ++i)
      if (v[i].second < M || v[i].first == 'F') end = i + 1;
    v.resize(end);
    return v;
  };
  std::vector<std::pair<char, int>> done;  // this step's entries the previous step's part ran
  if (k_done > 0)
    for (const auto& [kind, mb] : part(k_done))
      if (mb >= M) done.push_back({kind, mb - M});
  std::vector<StepEntry> out;
  for (const auto& [kind, mb] : part(k_next)) {
    if (mb >= M) {
      out.push_back({kind, mb - M, true});
    } else if (std::find(done.begin(), done.end(), std::make_pair(kind, mb)) == done.end()) {
      out.push_back({kind, mb, false});
    }
  }
  return out;
}

int MaxInFlightForOverlap(int micro_batches, int k) { return std::max(1, micro_batches - k + 1); }

int DilocoSyncPeriod(int inner_steps, int fragments) { return std::max(1, inner_steps / std::max(1, fragments)); }

int FragmentDueAfter(int64_t step, int inner_steps, int fragments) {
  const int64_t period = DilocoSyncPeriod(inner_steps, fragments);
  const int64_t t = step + 1;
  if (t % period != 0) return -1;
  return static_cast<int>((t / period) % std::max(1, fragments));
}

int EarlyMicroBatches(int k, int64_t step, int64_t total_steps, int checkpoint_interval, int sync_period) {
  if (k <= 0 || step <= 0 || step >= total_steps) return 0;
  if (checkpoint_interval > 0 && step % checkpoint_interval == 0) return 0;
  if (sync_period > 0 && step % sync_period == 0) return 0;
  return k;
}

bool InFlightIsDeadlockFree(const std::vector<int>& in_flight) {
  for (size_t k = 0; k < in_flight.size(); ++k) {
    if (in_flight[k] < 1) return false;
    if (k + 1 < in_flight.size() && in_flight[k + 1] > in_flight[k]) return false;
  }
  return true;
}

namespace {

// Steps simulated for PipelineTimes::step_overlap: the first begins exact, as a run's first does, and runs
// the second's early forward passes besides its own, so it ends late; the step reported is the mean of
// the steps after the second (each begins K micro-batches in the one before), its figures the last one's.
// (Measured from the first step's end, the mean read a steady step short by those passes over the number
// of steps: 1.2% at five on two DiLoCo pipelines, still 0.3% at twenty.)
constexpr int kOverlapSteps = 5;

}  // namespace

SimulatedStep SimulatePipeline(const PipelineTimes& t) {
  const int S = static_cast<int>(t.forward_seconds.size());
  const int M = t.micro_batches;
  // job.step_overlap: consecutive steps, each stage's part of each (OverlappedStepSchedule) ending with the
  // norm's exchange and its optimizer step; otherwise one exact step.
  const int K = t.step_overlap > 0 && M > 1 ? std::min(t.step_overlap, M - 1) : 0;
  const bool overlapped = K > 0;
  const int steps = overlapped ? kOverlapSteps : 1;
  const int reported = steps - 1;
  // Micro-batch m of step s is g = s * M + m; the last step's part runs the first of the step after it.
  const int G = (steps + 1) * M;
  SimulatedStep r;
  r.busy_seconds.assign(S, 0.0);
  r.wait_seconds.assign(S, 0.0);
  r.finish_seconds.assign(S, 0.0);
  r.forward_link_busy_seconds.assign(std::max(S - 1, 0), 0.0);
  r.backward_link_busy_seconds.assign(std::max(S - 1, 0), 0.0);
  r.passes.assign(S, {});
  // What a stage's site does, in order: ('F', g) and ('B', g) passes; with the overlap, 'U' (after the
  // step's last backward pass: the norm's partial sums up the pipeline, awaited before the next step's early
  // passes) and 'E' (the part's end: the total down the pipeline, then the optimizer step).
  struct Item {
    char kind;
    int g;
    int part;  // the step whose part runs it
  };
  // One unit per site computing a stage: each replica of a replicated stage runs the stage's order
  // filtered to its own micro-batches.
  struct Unit {
    int stage;
    double scale = 1;  // of the stage's pass times
    std::vector<Item> order;
    size_t next = 0;
    double free_at = 0, busy = 0, wait = 0;
    bool started = false;
    bool at_marker = false;  // reached order[next], a 'U' or an 'E', and counted there
    // With the overlap, per part: its passes' work, its waits, and when it began and ended.
    std::vector<double> part_busy, part_wait, part_begin, part_end;
  };
  // Each stage's replica count, once: the links below look it up for every transfer.
  std::vector<int> replicas(S);
  for (int k = 0; k < S; ++k) replicas[k] = Replicas(t, k);
  auto owner = [&](int k, int g) { return replicas[k] > 1 ? t.owners[k][g % M] : 0; };  // stage k's replica of g
  std::vector<Unit> units;
  for (int k = 0; k < S; ++k) {
    const size_t first = units.size();
    for (int rep = 0; rep < replicas[k]; ++rep) {
      units.push_back(Unit{k, ReplicaScale(t, k, rep)});
      units.back().part_busy.assign(steps, 0.0);
      units.back().part_wait.assign(steps, 0.0);
      units.back().part_begin.assign(steps, 0.0);
      units.back().part_end.assign(steps, 0.0);
    }
    if (!overlapped) {
      for (auto [kind, m] : PipelineSchedule(k, S, M, DefaultInFlight(t, k)))
        units[first + owner(k, m)].order.push_back({kind, m, 0});
      continue;
    }
    for (int s = 0; s < steps; ++s) {
      const auto part = OverlappedStepSchedule(k, S, M, DefaultInFlight(t, k), s == 0 ? 0 : K, K);
      for (int rep = 0; rep < replicas[k]; ++rep) {
        Unit& u = units[first + rep];
        // After its last backward pass of the step; without one (no micro-batch of its own), at the part's end.
        size_t norm_at = 0;
        for (const StepEntry& e : part) {
          if (owner(k, e.micro_batch) != rep) continue;
          u.order.push_back({e.kind, (s + (e.next ? 1 : 0)) * M + e.micro_batch, s});
          if (e.kind == 'B' && !e.next) norm_at = u.order.size();
        }
        if (norm_at == 0) norm_at = u.order.size();
        u.order.insert(u.order.begin() + static_cast<std::ptrdiff_t>(norm_at), Item{'U', -1, s});
        u.order.push_back({'E', -1, s});
      }
    }
  }
  // Arrival time of stage k's input for micro-batch g (activation; stage 0: 0) and of its gradient.
  std::vector<std::vector<double>> act(S, std::vector<double>(G, kInf)), grad(S, std::vector<double>(G, kInf));
  for (int g = 0; g < G; ++g) act[0][g] = 0;
  // Each direction of each pair of sites is its own FIFO: link k's pair (replica of stage k, replica of
  // stage k + 1) that micro-batch g goes between, as the executors send over one stream per peer.
  auto pair = [&](int k, int g) { return owner(k, g) * replicas[k + 1] + owner(k + 1, g); };
  std::vector<std::vector<double>> fwd_link(std::max(S - 1, 0)), bwd_link(std::max(S - 1, 0));
  for (int k = 0; k + 1 < S; ++k) {
    fwd_link[k].assign(static_cast<size_t>(replicas[k]) * replicas[k + 1], 0.0);
    bwd_link[k] = fwd_link[k];
  }
  std::vector<double> forward_done(S * static_cast<size_t>(G), kInf);
  // The norm's exchange of each stage and step (with the overlap): how many of the stage's units reached
  // 'U' and 'E' and the latest of them, when the stage sends its partial sum up (`up`), and when the total
  // reaches it (`down`).
  struct Norm {
    int at_up = 0, at_end = 0;
    double up_reached = 0, end_reached = 0;
    double up = kInf, down = kInf;
  };
  std::vector<std::vector<Norm>> norm(S, std::vector<Norm>(steps));
  // Stage k's up, once every unit of it has reached 'U' and the next stage's partial sum is known.
  auto up_of = [&](int k, int s) {
    Norm& n = norm[k][s];
    if (n.up == kInf && n.at_up == replicas[k] && (k + 1 == S || norm[k + 1][s].up < kInf))
      n.up = k + 1 == S ? n.up_reached : std::max(n.up_reached, norm[k + 1][s].up + t.backward_latency_seconds[k]);
    return n.up;
  };
  // The total's arrival at stage k: stage 0 has it once its up is known and sends it on at once; a later
  // stage sends it on at the end of its part (its units at 'E'), having received it.
  auto down_of = [&](int k, int s) {
    if (norm[0][s].down == kInf) norm[0][s].down = up_of(0, s);
    for (int j = 1; j <= k; ++j) {
      if (norm[j][s].down < kInf) continue;
      const Norm& p = norm[j - 1][s];
      if (p.down == kInf || (j - 1 > 0 && p.at_end < replicas[j - 1])) return kInf;
      norm[j][s].down = std::max(p.down, j - 1 > 0 ? p.end_reached : 0.0) + t.forward_latency_seconds[j - 1];
    }
    return norm[k][s].down;
  };
  // Idles unit u until `until` (a marker's wait), counted in its part.
  auto idle = [&](Unit& u, double until, int part) {
    if (until <= u.free_at) return;
    u.part_wait[part] += until - u.free_at;
    u.free_at = until;
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (Unit& u : units) {
      const int k = u.stage;
      while (u.next < u.order.size()) {
        const Item item = u.order[u.next];
        if (item.kind == 'U' || item.kind == 'E') {
          Norm& n = norm[k][item.part];
          if (!u.at_marker) {
            u.at_marker = true;
            if (item.kind == 'U')
              ++n.at_up, n.up_reached = std::max(n.up_reached, u.free_at);
            else
              ++n.at_end, n.end_reached = std::max(n.end_reached, u.free_at);
          }
          if (item.kind == 'U') {
            const double up = up_of(k, item.part);
            if (up == kInf) break;
            idle(u, up, item.part);
          } else {
            const double down = down_of(k, item.part);
            if (down == kInf) break;
            idle(u, down, item.part);
            u.free_at += t.optimizer_seconds.empty() ? 0.0 : t.optimizer_seconds[k];
            u.part_end[item.part] = u.free_at;
            if (item.part + 1 < steps) u.part_begin[item.part + 1] = u.free_at;
          }
          u.at_marker = false;
          ++u.next;
          progress = true;
          continue;
        }
        const int g = item.g;
        double ready;
        if (item.kind == 'F')
          ready = act[k][g];
        else
          ready = k == S - 1 ? forward_done[k * static_cast<size_t>(G) + g] : grad[k][g];
        if (ready == kInf) break;
        if (item.kind == 'B' && RecomputeSeconds(t, k) > 0) {  // needs no gradient: at once
          const double again = RecomputeSeconds(t, k) * u.scale;
          if (item.part == reported) r.passes[k].push_back({'R', g % M, u.free_at, u.free_at + again});
          u.busy += again;
          u.part_busy[item.part] += again;
          u.free_at += again;
          u.started = true;
        }
        const double start = std::max(u.free_at, ready);
        if (u.started) u.wait += start - u.free_at;
        u.part_wait[item.part] += start - u.free_at;
        const double work =
            (item.kind == 'F' ? t.forward_seconds[k] : t.backward_seconds[k]) * u.scale + FrameSeconds(t, k, item.kind);
        const double end = start + work;
        u.busy += work;
        u.part_busy[item.part] += work;
        u.free_at = end;
        u.started = true;
        if (item.part == reported) r.passes[k].push_back({item.kind, g % M, start, end});
        if (item.kind == 'F') {
          forward_done[k * static_cast<size_t>(G) + g] = end;
          if (k + 1 < S) {
            double& link = fwd_link[k][pair(k, g)];
            link = std::max(end, link) + t.forward_transfer_seconds[k];
            if (item.part == reported) r.forward_link_busy_seconds[k] += t.forward_transfer_seconds[k];
            act[k + 1][g] = link + t.forward_latency_seconds[k];
          }
        } else if (k > 0) {
          double& link = bwd_link[k - 1][pair(k - 1, g)];
          link = std::max(end, link) + t.backward_transfer_seconds[k - 1];
          if (item.part == reported) r.backward_link_busy_seconds[k - 1] += t.backward_transfer_seconds[k - 1];
          grad[k - 1][g] = link + t.backward_latency_seconds[k - 1];
        }
        ++u.next;
        progress = true;
      }
    }
  }
  for (const Unit& u : units)
    if (u.next < u.order.size()) r.deadlocked = true;
  if (r.deadlocked) {
    r.step_seconds = kInf;
    return r;
  }
  if (overlapped) {
    // A step: the mean from the end of the second step (the last stage to end it) to the end of the last;
    // each stage's figures over its part of the last, its times from the earliest part's beginning.
    double second = 0, last = 0, base = kInf;
    for (const Unit& u : units) {
      second = std::max(second, u.part_end[1]);
      last = std::max(last, u.part_end[reported]);
      base = std::min(base, u.part_begin[reported]);
    }
    for (const Unit& u : units) {
      r.busy_seconds[u.stage] = std::max(r.busy_seconds[u.stage], u.part_busy[reported]);
      r.wait_seconds[u.stage] = std::max(r.wait_seconds[u.stage], u.part_wait[reported]);
      r.finish_seconds[u.stage] = std::max(r.finish_seconds[u.stage], u.part_end[reported] - base);
    }
    for (auto& stage : r.passes)
      for (auto& p : stage) p.start -= base, p.end -= base;
    r.step_seconds = (last - second) / (steps - 2);
    return r;
  }
  for (const Unit& u : units) {
    r.busy_seconds[u.stage] = std::max(r.busy_seconds[u.stage], u.busy);
    r.wait_seconds[u.stage] = std::max(r.wait_seconds[u.stage], u.wait);
    r.finish_seconds[u.stage] = std::max(r.finish_seconds[u.stage], u.free_at);
  }
  // The gradient norm: partial sums from the last stage to the first, the total back to every stage.
  double up = S ? r.finish_seconds[S - 1] : 0.0;
  for (int k = S - 2; k >= 0; --k) up = std::max(r.finish_seconds[k], up + t.backward_latency_seconds[k]);
  double down = up, end = up;
  for (int k = 1; k < S; ++k) {
    down += t.forward_latency_seconds[k - 1];
    end = std::max(end, down);
  }
  r.step_seconds = end;
  return r;
}

std::vector<int> ChooseInFlight(const PipelineTimes& t, const std::vector<int>& max_in_flight) {
  const int S = static_cast<int>(t.forward_seconds.size());
  const int M = t.micro_batches;
  std::vector<int> lo(S), hi(S), d(S);
  for (int k = 0; k < S; ++k) {
    hi[k] = std::max(1, std::min(max_in_flight[k], M));
    lo[k] = std::max(1, std::min(S - k, hi[k]));
  }
  // The steady pace: the slowest stage's passes or the slowest link direction. A replicated stage's
  // replicas share its micro-batches, each doing its frames' work on its own.
  double pace = 0;
  auto passes = [&](int k) { return t.forward_seconds[k] + RecomputeSeconds(t, k) + t.backward_seconds[k]; };
  auto frames = [&](int k) { return FrameSeconds(t, k, 'F') + FrameSeconds(t, k, 'B'); };
  for (int k = 0; k < S; ++k) pace = std::max(pace, passes(k) + frames(k) / Replicas(t, k));
  for (int k = 0; k + 1 < S; ++k)
    pace = std::max({pace, t.forward_transfer_seconds[k], t.backward_transfer_seconds[k]});
  // A micro-batch's passes at a replicated stage take its slowest replica's time, not the combined pace.
  auto slowest = [&](int k) {
    double x = 1;
    for (int r = 0; r < Replicas(t, k); ++r) x = std::max(x, ReplicaScale(t, k, r));
    return passes(k) * x + frames(k);
  };
  // Round trip of a micro-batch from stage k's forward pass to its gradient's return, plus the pass.
  for (int k = 0; k < S; ++k) {
    double trip = slowest(k);
    for (int j = k; j + 1 < S; ++j)
      trip += t.forward_transfer_seconds[j] + t.forward_latency_seconds[j] + t.backward_transfer_seconds[j] +
              t.backward_latency_seconds[j] + slowest(j + 1);
    const int need = pace > 0 ? static_cast<int>(std::min<double>(std::ceil(trip / pace - 1e-9), M)) : 1;
    d[k] = std::clamp(need, lo[k], hi[k]);
  }
  for (int k = 1; k < S; ++k) d[k] = std::min(d[k], d[k - 1]);  // never increasing along the pipeline
  PipelineTimes trial = t;
  auto cost = [&](const std::vector<int>& depth) {
    trial.in_flight = depth;
    return SimulatePipeline(trial).step_seconds;
  };
  double best = cost(d);
  // Coordinate descent: each stage's depth within what its neighbours allow, for the shortest step. A
  // range of more than kFullRange depths (hundreds of micro-batches) is sampled: its ends and the
  // current depth plus and minus powers of two, so that each try stays O(log M) simulations.
  constexpr int kFullRange = 32;
  for (int round = 0; round < 3; ++round) {
    bool improved = false;
    for (int k = 0; k < S; ++k) {
      const int from = std::max(lo[k], k + 1 < S ? d[k + 1] : 1);
      const int to = std::min(hi[k], k > 0 ? d[k - 1] : hi[k]);
      std::vector<int> tries;
      if (to - from <= kFullRange) {
        for (int v = from; v <= to; ++v) tries.push_back(v);
      } else {
        tries = {from, to};
        for (int step = 1; step <= to - from; step *= 2)
          for (int v : {d[k] - step, d[k] + step})
            if (v >= from && v <= to) tries.push_back(v);
      }
      for (int v : tries) {
        if (v == d[k]) continue;
        std::vector<int> c = d;
        c[k] = v;
        if (const double x = cost(c); x < best * (1 - 1e-9)) best = x, d = c, improved = true;
      }
    }
    if (!improved) break;
  }
  // Then as shallow as costs at most kDepthTolerance over that step: memory, and fewer stashed
  // activations, are worth more than a step shorter by a fraction of a percent. Last stage first: each
  // stage's depth bounds the previous one's from below.
  constexpr double kDepthTolerance = 0.005;
  const double limit = best * (1 + kDepthTolerance);
  for (int k = S - 1; k >= 0; --k) {
    const int floor = std::max(lo[k], k + 1 < S ? d[k + 1] : 1);
    if (d[k] - floor > kFullRange) {
      // Bisection for the shallowest depth within the limit (the step does not grow with depth here).
      int ok = d[k], bad = floor - 1;
      while (ok - bad > 1) {
        const int mid = bad + (ok - bad) / 2;
        std::vector<int> c = d;
        c[k] = mid;
        (cost(c) > limit ? bad : ok) = mid;
      }
      d[k] = ok;
      continue;
    }
    while (d[k] > floor) {
      std::vector<int> c = d;
      --c[k];
      if (cost(c) > limit) break;
      d = c;
    }
  }
  return d;
}

}  // namespace meridian::partitioner
