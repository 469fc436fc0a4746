// Parsing of quantities written as people write them: "100Mbit", "1.5Gbps", "40ms", "16GiB".
// Pure functions; thread-safe.
#ifndef MERIDIAN_CORE_UNITS_H_
#define MERIDIAN_CORE_UNITS_H_

#include <string>

#include "absl/status/statusor.h"

namespace meridian::core {

// Bandwidth in bytes per second. Accepts a number followed by one of
// bit, Kbit, Mbit, Gbit, Tbit (also bps, Kbps, Mbps, Gbps, Tbps: decimal bits per second) or
// B/s, KB/s, MB/s, GB/s (decimal bytes), KiB/s, MiB/s, GiB/s (binary bytes). Case of the prefix letter
// is ignored except that "b" means bits and "B" bytes. A bare number is rejected (the unit is required).
// Errors: InvalidArgument describing the accepted forms.
absl::StatusOr<double> ParseBandwidth(const std::string& text);

// Duration in seconds: number followed by ns, us, ms, s, m (minutes) or h. A bare number is rejected.
absl::StatusOr<double> ParseDuration(const std::string& text);

// Size in bytes: number followed by B, KB, MB, GB, TB (decimal) or KiB, MiB, GiB, TiB (binary).
// A bare non-negative integer is accepted as bytes.
absl::StatusOr<double> ParseBytes(const std::string& text);

// Human-readable renderings used in tables and logs ("95.4 Mbit/s", "40.0 ms", "1.50 GiB").
std::string FormatBandwidth(double bytes_per_second);
std::string FormatDuration(double seconds);
std::string FormatBytes(double bytes);

}  // namespace meridian::core

#endif  // MERIDIAN_CORE_UNITS_H_
