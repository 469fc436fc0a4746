// Logging for Meridian's processes: one stderr logger per process with UTC timestamps, levels and the
// program's name, e.g. "2026-12-01T18:10:00.123Z warning meridian-executor: heartbeat failed (...)".
// Libraries return Status and do not log (docs/errors.md); the processes' loops -- the executor's agent
// and stage worker, the coordinator's run loop -- log through spdlog's default logger, which InitLogging
// sets up. A command's own output (tables, progress lines, JSON) goes to stdout, not through here.
#ifndef MERIDIAN_CORE_LOG_H_
#define MERIDIAN_CORE_LOG_H_

#include <spdlog/spdlog.h>

#include <string>

#include "absl/status/status.h"

namespace meridian::core {

// The levels --log-level takes, least to most severe.
inline constexpr const char* kLogLevels[] = {"trace", "debug", "info", "warning", "error", "off"};

// Makes `program` the default logger's name and `level` its threshold (one of kLogLevels; "warn" is
// taken for "warning"). InvalidArgument, naming the flag and the choices, for another level. Call once,
// early in main, before other threads log.
absl::Status InitLogging(const std::string& program, const std::string& level);

// A string another party sent (a site's error, a remote log's line), safe for the operator's terminal and
// the logs: control characters (escape sequences, carriage returns, newlines) become \xNN, and at most
// `max` bytes are kept ("..." marks a cut). Pure and thread-safe.
std::string Printable(const std::string& text, size_t max = 4000);

}  // namespace meridian::core

#endif  // MERIDIAN_CORE_LOG_H_
