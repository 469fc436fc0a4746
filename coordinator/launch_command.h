// `meridian launch CLUSTER --coordinator ADDR [--accept-new-host-keys]`: starts the executor of every site
// whose spec has `ssh:` (launch/launch.h), then stays in the foreground printing their problem lines until
// they have all exited or Ctrl-C, which stops them. `meridian run --launch ssh` does the same through
// LaunchSshSites. docs/launch.md.
#ifndef MERIDIAN_COORDINATOR_LAUNCH_COMMAND_H_
#define MERIDIAN_COORDINATOR_LAUNCH_COMMAND_H_

#include <signal.h>

#include <atomic>
#include <string>

#include "absl/status/status.h"
#include "core/cluster_spec.h"
#include "launch/launch.h"

namespace CLI {
class App;
}

namespace meridian::coordinator {

// Starts every `ssh:` site of `spec` at once, each joining `coordinator` with its bundle from `certs_dir`.
// On any failure stops those that started and returns every site's error, one per line. Errors: the spec
// has no `ssh:` site (InvalidArgument), or what Launch said (naming the site).
absl::Status LaunchSshSites(const core::ClusterSpec& spec, const std::string& certs_dir, const std::string& coordinator,
                            launch::SshLauncher* launcher);

// The command that starts `site`'s executor by hand, joining `coordinator` with its bundle from
// `certs_dir`: what `meridian run` prints for each site, and `meridian launch` for a site without ssh:.
std::string JoinCommand(const core::SiteSpec& site, const std::string& certs_dir, const std::string& coordinator);

// Set (to the signal's number) by SIGINT and SIGTERM while a ScopedInterruptHandler lives
// (async-signal-safe); the commands poll it to stop their sites before they exit.
extern std::atomic<int> g_interrupted;
// Catches SIGINT and SIGTERM for its lifetime; the destructor puts the previous handlers back, so that
// what runs afterwards (the export and evaluation after `meridian run`) can be interrupted as usual.
class ScopedInterruptHandler {
 public:
  ScopedInterruptHandler();
  ~ScopedInterruptHandler();
  ScopedInterruptHandler(const ScopedInterruptHandler&) = delete;
  ScopedInterruptHandler& operator=(const ScopedInterruptHandler&) = delete;

 private:
  struct sigaction old_int_, old_term_;
};

struct LaunchCommandOptions {
  std::string cluster_path, coordinator;
  bool accept_new_host_keys = false;
};
void AddLaunchOptions(CLI::App* cmd, LaunchCommandOptions* o);
// 0 when every executor exited, 128 + the signal after Ctrl-C (130) or SIGTERM (143) (they were stopped),
// 1 when a site could not be started (the others were stopped), 2 on invalid input.
int RunLaunch(const LaunchCommandOptions& o);

}  // namespace meridian::coordinator

#endif  // MERIDIAN_COORDINATOR_LAUNCH_COMMAND_H_
