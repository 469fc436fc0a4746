// How an executor is configured: command-line flags over MERIDIAN_* environment variables over the
// cluster spec (when --spec is given). Pure; thread-safe.
#ifndef MERIDIAN_EXECUTOR_OPTIONS_H_
#define MERIDIAN_EXECUTOR_OPTIONS_H_

#include <functional>
#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace meridian::executor {

struct ExecutorOptions {
  std::string coordinator;  // host:port of the coordinator
  std::string site;         // this executor's site name (the CN of its certificate)
  std::string certs;        // directory with ca.pem, SITE.pem, SITE.key (from the spec: its bundles/SITE)
  std::string listen;       // host:port for the peer service (default: the site's address in the spec)
  std::string device = "cpu";
  // Fault injection, for the hostile-site tests only (`--fault nan-gradient:STEP`): at optimizer step STEP
  // (0-based) of the first attempt that reaches it, this site sends its previous stage a NaN activation
  // gradient, as a compromised or broken site would. -1: none.
  int64_t fault_nan_gradient_step = -1;
  // (`--fault late-boundary:SECONDS`) the heartbeat answers' step boundary reaches this site's stages
  // SECONDS after it first comes, as if those answers were that late (the lease the coordinator granted
  // still comes at once). 0: none.
  double fault_late_boundary_seconds = 0;
};

// Values given on the command line; unset ones fall back to the environment, then the spec.
struct ExecutorFlags {
  std::optional<std::string> coordinator, site, certs, listen, device, spec;
};

// Resolves the options. `getenv` looks up MERIDIAN_COORDINATOR, MERIDIAN_SITE, MERIDIAN_CERTS,
// MERIDIAN_LISTEN, MERIDIAN_DEVICE and MERIDIAN_SPEC. Errors: InvalidArgument naming the missing or
// malformed setting and where it came from.
absl::StatusOr<ExecutorOptions> ResolveOptions(const ExecutorFlags& flags,
                                               const std::function<std::optional<std::string>(const char*)>& getenv);

}  // namespace meridian::executor

#endif  // MERIDIAN_EXECUTOR_OPTIONS_H_
