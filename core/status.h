// Error-handling vocabulary shared by every Meridian module.
//
// Policy (docs/errors.md): recoverable failures -- bad input, unreachable peers, I/O errors -- travel as
// absl::Status / absl::StatusOr<T> and carry a message that names the file, field or peer involved.
// Broken invariants (bugs) abort through MERIDIAN_CHECK with a message. No exception crosses a module
// boundary; libtorch's c10::Error is converted to a Status at the executor's edge.
#ifndef MERIDIAN_CORE_STATUS_H_
#define MERIDIAN_CORE_STATUS_H_

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace meridian::core {

// `s` with `prefix` and ": " put before its message (same code): adds where an error happened, e.g.
// Annotate(s, "stage 1 (site 'b')"). REQUIRES: !s.ok().
inline absl::Status Annotate(const absl::Status& s, const std::string& prefix) {
  return absl::Status(s.code(), prefix + ": " + std::string(s.message()));
}

}  // namespace meridian::core

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define MERIDIAN_RETURN_IF_ERROR(expr)                   \
  do {                                                   \
    ::absl::Status meridian_status_ = (expr);            \
    if (!meridian_status_.ok()) return meridian_status_; \
  } while (0)

#define MERIDIAN_CONCAT_INNER_(a, b) a##b
#define MERIDIAN_CONCAT_(a, b) MERIDIAN_CONCAT_INNER_(a, b)

// `lhs` = value of `rexpr` (an absl::StatusOr<T>), or returns its status from the enclosing function.
#define MERIDIAN_ASSIGN_OR_RETURN(lhs, rexpr) \
  MERIDIAN_ASSIGN_OR_RETURN_IMPL_(MERIDIAN_CONCAT_(meridian_statusor_, __LINE__), lhs, rexpr)
#define MERIDIAN_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                    \
  if (!tmp.ok()) return tmp.status();                    \
  lhs = std::move(tmp).value()

// Aborts with file, line and message when an invariant does not hold. For bugs only, never for input.
#define MERIDIAN_CHECK(cond, msg)                                                                     \
  do {                                                                                                \
    if (!(cond)) {                                                                                    \
      std::fprintf(stderr, "%s:%d: MERIDIAN_CHECK(%s) failed: %s\n", __FILE__, __LINE__, #cond, msg); \
      std::abort();                                                                                   \
    }                                                                                                 \
  } while (0)

#endif  // MERIDIAN_CORE_STATUS_H_
