// Looking at a running job from outside, over the coordinator's mutual-TLS service (Inspect RPC):
// - `meridian status --coordinator ADDR --certs DIR [--as NAME] [--json]`: progress and every site's state;
// - `meridian profile --coordinator ADDR --certs DIR [--out FILE]`: the run's measured profile.json;
// - `meridian plan --live --coordinator ADDR --certs DIR`: plans again over that profile (plan_command.h);
// - `meridian drain SITE --coordinator ADDR --certs DIR`: the site leaves at the next step boundary (the
//   operator's identity only).
// The caller presents the certificate NAME (default "coordinator", the operator's) from DIR.
#ifndef MERIDIAN_COORDINATOR_INSPECT_H_
#define MERIDIAN_COORDINATOR_INSPECT_H_

#include <string>

#include "absl/status/statusor.h"

namespace CLI {
class App;
}

namespace meridian::coordinator {

struct LiveRun {
  std::string status_json, profile_json, graph_json, plan_json;
};

// One Inspect call with a 10 s deadline. Errors name the address: Unavailable when nothing answers,
// PermissionDenied for an identity the coordinator does not accept, FailedPrecondition naming the
// certificate files when they cannot be read.
absl::StatusOr<LiveRun> InspectCoordinator(const std::string& address, const std::string& certs_dir,
                                           const std::string& identity);

struct InspectOptions {
  std::string address, certs_dir, identity = "coordinator", out_path;
  bool json = false;
  std::string site;  // drain
};
void AddStatusOptions(CLI::App* cmd, InspectOptions* options);
// Returns 0, 1 when the coordinator cannot be reached or refuses, 2 on invalid input.
int RunStatus(const InspectOptions& options);
void AddProfileOptions(CLI::App* cmd, InspectOptions* options);
int RunProfile(const InspectOptions& options);
void AddDrainOptions(CLI::App* cmd, InspectOptions* options);
// 0 once the coordinator accepted; 1 when it cannot be reached or refuses (an unknown or unjoined site
// is named), 2 on invalid input.
int RunDrain(const InspectOptions& options);

}  // namespace meridian::coordinator

#endif  // MERIDIAN_COORDINATOR_INSPECT_H_
