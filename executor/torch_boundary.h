// The torch boundary: libtorch reports errors by throwing (c10::Error and its subclasses, std::bad_alloc
// from allocators), Meridian by returning absl::Status (docs/errors.md). Every public entry of the
// executor's stage worker, profiler, trainer, evaluation, export and checkpoint loading runs its body
// through GuardTorch, so no exception crosses into the agent, its threads or the coordinator's
// protocol: a torch failure becomes a Status the stage reports at once. Thread-safe (pure functions).
#ifndef MERIDIAN_EXECUTOR_TORCH_BOUNDARY_H_
#define MERIDIAN_EXECUTOR_TORCH_BOUNDARY_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace meridian::executor {

// The exception being handled (call only inside a catch block) as a Status whose message is
// "`what`: <the exception's message, without libtorch's backtrace>". Out of memory -- c10's
// OutOfMemoryError, std::bad_alloc, or an allocator's "not enough memory" / "out of memory" -- becomes
// ResourceExhausted; any other exception Internal.
absl::Status StatusOfCurrentException(absl::string_view what);

// Runs `body` (which returns absl::Status or absl::StatusOr<T>) and returns its result; an exception it
// throws is returned as StatusOfCurrentException(what) instead.
template <typename Body>
auto GuardTorch(absl::string_view what, Body&& body) -> decltype(body()) {
  try {
    return body();
  } catch (...) {
    return StatusOfCurrentException(what);
  }
}

}  // namespace meridian::executor

#endif  // MERIDIAN_EXECUTOR_TORCH_BOUNDARY_H_
