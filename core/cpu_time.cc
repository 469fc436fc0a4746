#include "core/cpu_time.h"

#include <sys/resource.h>
#include <time.h>

namespace meridian::core {
namespace {
double Seconds(clockid_t clock) {
  timespec ts{};
  ::clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}
}  // namespace

double ProcessCpuSeconds() { return Seconds(CLOCK_PROCESS_CPUTIME_ID); }
double ThreadCpuSeconds() { return Seconds(CLOCK_THREAD_CPUTIME_ID); }

int64_t ThreadPreemptions() {
  rusage u{};
  if (::getrusage(RUSAGE_THREAD, &u) != 0) return 0;
  return static_cast<int64_t>(u.ru_nivcsw);
}

}  // namespace meridian::core
