// The figures of a stage's step (v1::MetricsReport) that every view of a run shows under one name:
// RUN/metrics.jsonl's `stages[]` (RunMachine), `meridian status --json`'s and /api/run's sites' `metrics`
// (Coordinator::StatusJson), and /metrics' gauges `meridian_site_KEY` (run.cc). A figure added here
// appears in all three. Constant data and pure functions: thread-safe.
#ifndef MERIDIAN_COORDINATOR_STEP_FIGURES_H_
#define MERIDIAN_COORDINATOR_STEP_FIGURES_H_

#include <array>

#include <nlohmann/json.hpp>

#include "proto/meridian.pb.h"

namespace meridian::coordinator {

struct StepFigure {
  const char* key;   // the JSON key; /metrics names the gauge meridian_site_<key>
  const char* help;  // /metrics' HELP text
  double (*get)(const v1::MetricsReport&);
  bool count;  // a count (a JSON integer), else seconds
};

// Where the step's time went, the CPU it used, and how often its compute thread was preempted
// (docs/executor.md defines each).
extern const std::array<StepFigure, 8> kStepFigures;

// {"step": 1-based, "step_seconds", then each of kStepFigures by its key}: what both JSON views of a
// stage's latest step start from (each adds its own fields).
nlohmann::json StepFiguresJson(const v1::MetricsReport& m);

}  // namespace meridian::coordinator

#endif  // MERIDIAN_COORDINATOR_STEP_FIGURES_H_
