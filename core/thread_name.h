// Names for this process's threads, as `top -H`, `ps -L`, /proc/PID/task/TID/comm and gdb show them: the
// executor's transport, receive-ahead, replica and report threads each carry one, so that a site's CPU can
// be told apart by thread (bench/run_all.py's per-thread breakdown reads them). Thread-safe.
#ifndef MERIDIAN_CORE_THREAD_NAME_H_
#define MERIDIAN_CORE_THREAD_NAME_H_

#include <string>
#include <string_view>
#include <thread>
#include <utility>

namespace meridian::core {

// Names the calling thread `name`, cut to the kernel's 15 characters. Best effort: a failure leaves the
// inherited name (a name is a diagnostic, never a contract).
void NameThisThread(std::string_view name);

// The calling thread's name ("" if it cannot be read).
std::string ThisThreadName();

// A thread that names itself `name` (NameThisThread) and then runs `body`. Throws what std::thread's
// constructor throws.
template <typename F>
std::thread NamedThread(std::string name, F&& body) {
  return std::thread([name = std::move(name), body = std::forward<F>(body)]() mutable {
    NameThisThread(name);
    body();
  });
}

}  // namespace meridian::core

#endif  // MERIDIAN_CORE_THREAD_NAME_H_
