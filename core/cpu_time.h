// CPU time clocks of this process and of the calling thread. Thread-safe.
#ifndef MERIDIAN_CORE_CPU_TIME_H_
#define MERIDIAN_CORE_CPU_TIME_H_

namespace meridian::core {

// CPU seconds (user and system) this process has used, all its threads (CLOCK_PROCESS_CPUTIME_ID).
double ProcessCpuSeconds();
// CPU seconds (user and system) the calling thread has used (CLOCK_THREAD_CPUTIME_ID).
double ThreadCpuSeconds();

}  // namespace meridian::core

#endif  // MERIDIAN_CORE_CPU_TIME_H_
