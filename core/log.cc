#include "core/log.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_sinks.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace meridian::core {

absl::Status InitLogging(const std::string& program, const std::string& level) {
  spdlog::level::level_enum threshold;
  if (level == "trace")
    threshold = spdlog::level::trace;
  else if (level == "debug")
    threshold = spdlog::level::debug;
  else if (level == "info")
    threshold = spdlog::level::info;
  else if (level == "warning" || level == "warn")
    threshold = spdlog::level::warn;
  else if (level == "error")
    threshold = spdlog::level::err;
  else if (level == "off")
    threshold = spdlog::level::off;
  else
    return absl::InvalidArgumentError(absl::StrCat("--log-level: '", level, "' is not one of ",
                                                   absl::StrJoin(std::begin(kLogLevels), std::end(kLogLevels), ", ")));
  auto logger = std::make_shared<spdlog::logger>(program, std::make_shared<spdlog::sinks::stderr_sink_mt>());
  logger->set_formatter(std::make_unique<spdlog::pattern_formatter>(
      absl::StrCat("%Y-%m-%dT%H:%M:%S.%eZ %l ", program, ": %v"), spdlog::pattern_time_type::utc));
  logger->set_level(threshold);
  logger->flush_on(spdlog::level::trace);  // every line, at once: these are a daemon's diagnostics
  spdlog::set_default_logger(logger);
  return absl::OkStatus();
}

std::string Printable(const std::string& text, size_t max) {
  std::string out;
  for (unsigned char ch : text.substr(0, max))
    if (ch < 0x20 || ch == 0x7f)
      absl::StrAppendFormat(&out, "\\x%02x", ch);
    else
      out += static_cast<char>(ch);
  if (text.size() > max) out += "...";
  return out;
}

}  // namespace meridian::core
