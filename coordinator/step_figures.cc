#include "coordinator/step_figures.h"

namespace meridian::coordinator {

const std::array<StepFigure, 8> kStepFigures = {{
    {"compute_seconds", "Compute time of the site's stage in its last step.",
     [](const v1::MetricsReport& m) { return m.compute_seconds(); }, false},
    {"wait_seconds",
     "Time the site's compute thread waited for a peer (inputs, gradients, norm, replica sums) in its last step.",
     [](const v1::MetricsReport& m) { return m.wait_seconds(); }, false},
    {"send_blocked_seconds",
     "Time the site's compute thread was blocked by a send (a full send queue) in its last step.",
     [](const v1::MetricsReport& m) { return m.send_blocked_seconds(); }, false},
    {"codec_seconds", "Time the site's compute thread encoded and decoded frames in its last step.",
     [](const v1::MetricsReport& m) { return m.codec_seconds(); }, false},
    {"cpu_seconds", "CPU time of the site's executor process, all threads, in its last step.",
     [](const v1::MetricsReport& m) { return m.cpu_seconds(); }, false},
    {"compute_thread_cpu_seconds", "CPU time of the site's compute thread, the whole of its last step.",
     [](const v1::MetricsReport& m) { return m.compute_thread_cpu_seconds(); }, false},
    {"compute_cpu_seconds",
     "CPU time of the site's compute thread within its passes and optimizer step in its last step.",
     [](const v1::MetricsReport& m) { return m.compute_cpu_seconds(); }, false},
    {"compute_thread_preemptions",
     "Times the site's compute thread was preempted (taken off its core while runnable) in its last step.",
     [](const v1::MetricsReport& m) { return static_cast<double>(m.compute_thread_preemptions()); }, true},
}};

nlohmann::json StepFiguresJson(const v1::MetricsReport& m) {
  nlohmann::json j = {{"step", m.step() + 1}, {"step_seconds", m.step_seconds()}};
  for (const StepFigure& f : kStepFigures) {
    if (f.count)
      j[f.key] = static_cast<int64_t>(f.get(m));
    else
      j[f.key] = f.get(m);
  }
  return j;
}

}  // namespace meridian::coordinator
