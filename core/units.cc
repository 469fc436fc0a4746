#include "core/units.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace meridian::core {
namespace {

struct Split {
  double value = 0;
  std::string unit;
};

// Splits "  12.5 Mbit " into 12.5 and "Mbit". Rejects empty, negative, non-finite, or missing numbers.
absl::StatusOr<Split> SplitNumber(const std::string& text, const char* what) {
  size_t b = 0, e = text.size();
  while (b < e && std::isspace(static_cast<unsigned char>(text[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(text[e - 1]))) --e;
  std::string s = text.substr(b, e - b);
  if (s.empty()) return absl::InvalidArgumentError(absl::StrCat("empty ", what));
  size_t i = (s[0] == '-' || s[0] == '+') ? 1 : 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.' || s[i] == 'e' || s[i] == 'E' ||
                          ((s[i] == '+' || s[i] == '-') && i > 0 && (s[i - 1] == 'e' || s[i - 1] == 'E')))) {
    // Stop at an 'e'/'E' that begins a unit rather than an exponent (e.g. no digit follows).
    if ((s[i] == 'e' || s[i] == 'E') && !(i + 1 < s.size() && (std::isdigit(static_cast<unsigned char>(s[i + 1])) ||
                                                               s[i + 1] == '+' || s[i + 1] == '-')))
      break;
    ++i;
  }
  if (i == 0 || (i == 1 && !std::isdigit(static_cast<unsigned char>(s[0]))))
    return absl::InvalidArgumentError(absl::StrCat("'", s, "' is not a ", what, ": it must start with a number"));
  std::string num = s.substr(0, i);
  char* end = nullptr;
  double v = std::strtod(num.c_str(), &end);
  if (end != num.c_str() + num.size() || !std::isfinite(v))
    return absl::InvalidArgumentError(absl::StrCat("'", s, "' is not a ", what, ": bad number '", num, "'"));
  if (v < 0) return absl::InvalidArgumentError(absl::StrCat("'", s, "': ", what, " must not be negative"));
  size_t u = i;
  while (u < s.size() && std::isspace(static_cast<unsigned char>(s[u]))) ++u;
  return Split{v, s.substr(u)};
}

absl::StatusOr<double> Lookup(const std::string& text, const char* what, const std::map<std::string, double>& units,
                              const char* accepted, bool allow_bare) {
  auto split = SplitNumber(text, what);
  if (!split.ok()) return split.status();
  if (split->unit.empty()) {
    if (allow_bare) return split->value;
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "' has no unit; write the ", what, " with one of ", accepted));
  }
  auto it = units.find(split->unit);
  if (it == units.end())
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "': unknown ", what, " unit '", split->unit, "'; use one of ", accepted));
  double v = split->value * it->second;
  if (!std::isfinite(v)) return absl::InvalidArgumentError(absl::StrCat("'", text, "' is out of range"));
  return v;
}

}  // namespace

absl::StatusOr<double> ParseBandwidth(const std::string& text) {
  static const std::map<std::string, double> kUnits = [] {
    std::map<std::string, double> m;
    const std::pair<const char*, double> prefixes[] = {{"", 1},    {"K", 1e3}, {"k", 1e3},
                                                       {"M", 1e6}, {"G", 1e9}, {"T", 1e12}};
    for (auto [p, f] : prefixes) {
      for (const char* bits : {"bit", "bps", "bit/s", "b/s"}) m[std::string(p) + bits] = f / 8.0;
      for (const char* bytes : {"B/s", "Bps"}) m[std::string(p) + bytes] = f;
    }
    const std::pair<const char*, double> binary[] = {{"Ki", 1024.0}, {"Mi", 1048576.0}, {"Gi", 1073741824.0}};
    for (auto [p, f] : binary) {
      m[std::string(p) + "B/s"] = f;
      m[std::string(p) + "bit"] = f / 8.0;
    }
    return m;
  }();
  return Lookup(text, "bandwidth", kUnits, "bit, Kbit, Mbit, Gbit, Tbit, Mbps, MB/s, MiB/s, GB/s", false);
}

absl::StatusOr<double> ParseDuration(const std::string& text) {
  static const std::map<std::string, double> kUnits = {{"ns", 1e-9}, {"us", 1e-6},  {"µs", 1e-6},
                                                       {"ms", 1e-3}, {"s", 1.0},    {"sec", 1.0},
                                                       {"m", 60.0},  {"min", 60.0}, {"h", 3600.0}};
  return Lookup(text, "duration", kUnits, "ns, us, ms, s, min, h", false);
}

absl::StatusOr<double> ParseBytes(const std::string& text) {
  static const std::map<std::string, double> kUnits = {
      {"B", 1.0},   {"KB", 1e3},     {"kB", 1e3},        {"MB", 1e6},           {"GB", 1e9},
      {"TB", 1e12}, {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
  return Lookup(text, "size", kUnits, "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB", true);
}

std::string FormatBandwidth(double bps) {
  double bits = bps * 8;
  if (bits >= 1e9) return absl::StrFormat("%.2f Gbit/s", bits / 1e9);
  if (bits >= 1e6) return absl::StrFormat("%.1f Mbit/s", bits / 1e6);
  if (bits >= 1e3) return absl::StrFormat("%.1f Kbit/s", bits / 1e3);
  return absl::StrFormat("%.0f bit/s", bits);
}

std::string FormatDuration(double s) {
  if (s >= 1) return absl::StrFormat("%.3f s", s);
  if (s >= 1e-3) return absl::StrFormat("%.2f ms", s * 1e3);
  return absl::StrFormat("%.1f us", s * 1e6);
}

std::string FormatBytes(double b) {
  if (b >= 1073741824.0) return absl::StrFormat("%.2f GiB", b / 1073741824.0);
  if (b >= 1048576.0) return absl::StrFormat("%.1f MiB", b / 1048576.0);
  if (b >= 1024.0) return absl::StrFormat("%.1f KiB", b / 1024.0);
  return absl::StrFormat("%.0f B", b);
}

}  // namespace meridian::core
