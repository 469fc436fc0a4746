#include "coordinator/step_figures.h"

namespace meridian::coordinator {

const std::array<StepFigure, 7> kStepFigures = {{
    {"compute_seconds", "Compute time of the site's stage in its last step.", &v1::MetricsReport::compute_seconds},
    {"wait_seconds",
     "Time the site's compute thread waited for a peer (inputs, gradients, norm, replica sums) in its last step.",
     &v1::MetricsReport::wait_seconds},
    {"send_blocked_seconds",
     "Time the site's compute thread was blocked by a send (a full send queue) in its last step.",
     &v1::MetricsReport::send_blocked_seconds},
    {"codec_seconds", "Time the site's compute thread encoded and decoded frames in its last step.",
     &v1::MetricsReport::codec_seconds},
    {"cpu_seconds", "CPU time of the site's executor process, all threads, in its last step.",
     &v1::MetricsReport::cpu_seconds},
    {"compute_thread_cpu_seconds", "CPU time of the site's compute thread, the whole of its last step.",
     &v1::MetricsReport::compute_thread_cpu_seconds},
    {"compute_cpu_seconds",
     "CPU time of the site's compute thread within its passes and optimizer step in its last step.",
     &v1::MetricsReport::compute_cpu_seconds},
}};

nlohmann::json StepFiguresJson(const v1::MetricsReport& m) {
  nlohmann::json j = {{"step", m.step() + 1}, {"step_seconds", m.step_seconds()}};
  for (const StepFigure& f : kStepFigures) j[f.key] = (m.*f.get)();
  return j;
}

}  // namespace meridian::coordinator
