// CPU time clocks of this process and of the calling thread, and the calling thread's preemptions.
// Thread-safe.
#ifndef MERIDIAN_CORE_CPU_TIME_H_
#define MERIDIAN_CORE_CPU_TIME_H_

#include <cstdint>

namespace meridian::core {

// CPU seconds (user and system) this process has used, all its threads (CLOCK_PROCESS_CPUTIME_ID).
double ProcessCpuSeconds();
// CPU seconds (user and system) the calling thread has used (CLOCK_THREAD_CPUTIME_ID).
double ThreadCpuSeconds();
// Times the calling thread has been preempted: taken off its core while it could still run, for another
// thread or process (getrusage(RUSAGE_THREAD)'s involuntary context switches; waits it blocks in are not
// counted). What ran meanwhile may have evicted the thread's caches, which it then refills.
int64_t ThreadPreemptions();

}  // namespace meridian::core

#endif  // MERIDIAN_CORE_CPU_TIME_H_
