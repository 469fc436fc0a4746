#include "simulator/failures.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"

namespace meridian::simulator {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// One run of `L` seconds: the steps it keeps.
double KeptSteps(double T, double L, int interval, double C, double downtime, double rate, std::mt19937_64& rng) {
  std::exponential_distribution<double> lifetime(rate > 0 ? rate : 1.0);
  auto next_failure = [&](double from) { return rate > 0 ? from + lifetime(rng) : kInf; };
  double t = 0, kept = 0, fail = next_failure(0);
  const double segment = interval * T + C;
  while (t < L) {
    // Whole segments that end before the next failure and the run's end: at once (a run of a week in
    // steps of milliseconds has millions).
    const double n = std::floor((std::min(fail, L) - t) / segment);
    if (n >= 1) {
      t += n * segment;
      kept += n * interval;
      continue;
    }
    if (fail < std::min(t + segment, L)) {  // the steps since the newest checkpoint are lost
      t = fail + downtime;
      fail = next_failure(t);
      continue;
    }
    if (t + segment > L) {  // the run ends first: what it computed by then is kept (its final save)
      kept += std::min<double>(interval, std::floor((L - t) / T));
      break;
    }
    t += segment;
    kept += interval;
  }
  return kept;
}

}  // namespace

double AnalyticGoodput(double T, double M, int interval, double C, double downtime) {
  const double work = interval * T, s = work + C;
  if (!std::isfinite(M)) return work / s;
  return work / ((M + downtime) * std::expm1(s / M));
}

absl::StatusOr<FailureReport> SimulateFailures(double T, const FailureModel& m) {
  auto bad = [](const std::string& field, const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("failure model: ", field, ": ", why));
  };
  if (!(T > 0) || !std::isfinite(T)) return bad("step_seconds", "must be a positive number");
  if (m.mtbf_seconds.empty()) return bad("mtbf", "no sites");
  double rate = 0;
  for (const auto& [site, mtbf] : m.mtbf_seconds) {
    if (!(mtbf > 0)) return bad(absl::StrCat("mtbf of site '", site, "'"), "must be positive");
    rate += 1 / mtbf;  // 0 for a site that never fails
  }
  if (m.interval_steps < 1) return bad("checkpoint interval", "must be at least 1 step");
  for (auto [field, v] : {std::pair<const char*, double>{"detection_seconds", m.detection_seconds},
                          {"restore_seconds", m.restore_seconds},
                          {"checkpoint_seconds", m.checkpoint_seconds}})
    if (!(v >= 0) || !std::isfinite(v)) return bad(field, "must be a non-negative number");
  if (!(m.run_seconds >= T) || !std::isfinite(m.run_seconds)) return bad("run_seconds", "must be at least one step");
  if (m.trials < 1) return bad("trials", "must be at least 1");

  FailureReport r;
  r.step_seconds = T;
  r.system_mtbf_seconds = rate > 0 ? 1 / rate : kInf;
  r.expected_failures = m.run_seconds * rate;
  const double downtime = m.detection_seconds + m.restore_seconds;
  std::mt19937_64 rng(m.seed);
  std::vector<double> goodputs;
  goodputs.reserve(m.trials);
  for (int i = 0; i < m.trials; ++i)
    goodputs.push_back(KeptSteps(T, m.run_seconds, m.interval_steps, m.checkpoint_seconds, downtime, rate, rng) * T /
                       m.run_seconds);
  double sum = 0;
  for (double g : goodputs) sum += g;
  r.goodput = sum / m.trials;
  std::sort(goodputs.begin(), goodputs.end());
  r.goodput_p10 = goodputs[static_cast<size_t>(0.1 * (m.trials - 1))];
  const double M = r.system_mtbf_seconds;
  r.analytic_goodput = AnalyticGoodput(T, M, m.interval_steps, m.checkpoint_seconds, downtime);
  // The closed form is unimodal in the interval: rising while checkpoints dominate, falling once lost
  // work does. A ternary search over whole steps, up to where a segment would be ten MTBFs.
  const auto at = [&](int64_t k) { return AnalyticGoodput(T, M, static_cast<int>(k), m.checkpoint_seconds, downtime); };
  int64_t lo = 1, hi = std::isfinite(M) ? std::max<int64_t>(2, static_cast<int64_t>(std::min(10 * M / T, 1e9))) : 1;
  if (!std::isfinite(M)) hi = std::numeric_limits<int>::max();  // never fails: the longer, the better
  while (hi - lo > 2) {
    const int64_t a = lo + (hi - lo) / 3, b = hi - (hi - lo) / 3;
    if (at(a) < at(b))
      lo = a + 1;
    else
      hi = b;
  }
  int64_t best = lo;
  for (int64_t k = lo; k <= hi; ++k)
    if (at(k) > at(best)) best = k;
  r.best_interval_steps = static_cast<int>(std::min<int64_t>(best, std::numeric_limits<int>::max()));
  r.best_interval_goodput = at(best);
  r.young_interval_steps = std::isfinite(M) ? std::sqrt(2 * m.checkpoint_seconds * M) / T : kInf;
  return r;
}

}  // namespace meridian::simulator
