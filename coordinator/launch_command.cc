#include "coordinator/launch_command.h"

#include <signal.h>

#include <CLI/CLI.hpp>

#include <chrono>
#include <cstring>
#include <future>
#include <iostream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/certs.h"

namespace meridian::coordinator {

std::atomic<int> g_interrupted{0};

ScopedInterruptHandler::ScopedInterruptHandler() {
  g_interrupted.store(0);
  struct sigaction sa {};
  sa.sa_handler = [](int sig) { g_interrupted.store(sig); };
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &old_int_);
  sigaction(SIGTERM, &sa, &old_term_);
}

ScopedInterruptHandler::~ScopedInterruptHandler() {
  sigaction(SIGINT, &old_int_, nullptr);
  sigaction(SIGTERM, &old_term_, nullptr);
}

std::string JoinCommand(const core::SiteSpec& site, const std::string& certs_dir, const std::string& coordinator) {
  return absl::StrCat("meridian-executor --coordinator ", coordinator, " --site ", site.name, " --certs ",
                      core::SiteBundleDir(certs_dir, site.name), " --listen ", site.address.ToString(), " --device ",
                      site.devices.front());
}

absl::Status LaunchSshSites(const core::ClusterSpec& spec, const std::string& certs_dir, const std::string& coordinator,
                            launch::SshLauncher* launcher) {
  std::vector<launch::SiteLaunch> sites;
  for (const auto& site : spec.sites) {
    if (!site.ssh) continue;
    launch::SiteLaunch s;
    s.site = site.name;
    s.ssh = *site.ssh;
    s.bundle_dir = core::SiteBundleDir(certs_dir, site.name);
    s.coordinator = coordinator;
    s.listen = site.address.ToString();
    s.device = site.devices.front();
    sites.push_back(std::move(s));
  }
  if (sites.empty())
    return absl::InvalidArgumentError(
        "no site of the cluster spec has an 'ssh:' section; add one to each site to start over SSH (docs/launch.md)");
  // Every site at once, one thread each: the errors of all of them, in the spec's order.
  auto each = [&](absl::Status (launch::SshLauncher::*step)(const launch::SiteLaunch&)) {
    std::vector<std::future<absl::Status>> running;
    for (const auto& s : sites)
      running.push_back(std::async(std::launch::async, [launcher, step, &s] { return (launcher->*step)(s); }));
    std::string errors;
    for (auto& f : running)
      if (absl::Status st = f.get(); !st.ok()) absl::StrAppend(&errors, errors.empty() ? "" : "\n", st.message());
    return errors;
  };
  // Every site logged into and its executor's version checked before anything is copied or started, so
  // that a site that cannot work fails within one login and leaves nothing running anywhere.
  if (std::string errors = each(&launch::SshLauncher::Check); !errors.empty()) return absl::UnavailableError(errors);
  std::string errors = each(&launch::SshLauncher::Start);
  if (errors.empty()) return absl::OkStatus();
  launcher->StopAll();
  return absl::UnavailableError(errors);
}

void AddLaunchOptions(CLI::App* cmd, LaunchCommandOptions* o) {
  cmd->add_option("CLUSTER", o->cluster_path, "Cluster spec (YAML) whose sites have ssh: sections")->required();
  cmd->add_option("--coordinator", o->coordinator, "HOST:PORT the executors join (default: the spec's coordinator)");
  cmd->add_flag("--accept-new-host-keys", o->accept_new_host_keys,
                "On first contact, record an unknown host's key in known_hosts (and say which); a changed key is "
                "still refused");
}

int RunLaunch(const LaunchCommandOptions& o) {
  auto r = core::LoadSpecFile(o.cluster_path);
  if (!r.errors.empty()) {
    for (const auto& d : r.errors) std::cerr << d.ToString() << "\n";
    return 2;
  }
  if (!r.spec->cluster) {
    std::cerr << "meridian launch: " << o.cluster_path << ": not a cluster spec (no 'sites')\n";
    return 2;
  }
  const core::ClusterSpec& spec = *r.spec->cluster;
  ScopedInterruptHandler interrupts;
  launch::LaunchOptions lo;
  lo.accept_new_host_keys = o.accept_new_host_keys;
  launch::SshLauncher launcher(
      lo,
      [](const std::string& site, const std::string& line) { std::cerr << "site '" << site << "': " << line << "\n"; },
      [](const std::string& site, const std::string& msg) {
        std::cout << "launch: site '" << site << "': " << msg << "\n" << std::flush;
      });
  const std::string coordinator = o.coordinator.empty() ? spec.coordinator.ToString() : o.coordinator;
  const std::string certs = core::ResolveRelative(o.cluster_path, spec.certs_dir);
  auto interrupted = [&](int sig) {  // Ctrl-C or SIGTERM: every executor started is stopped
    std::cout << "launch: interrupted (" << strsignal(sig) << "); stopping the executors\n" << std::flush;
    launcher.StopAll();
    return 128 + sig;
  };
  if (absl::Status st = LaunchSshSites(spec, certs, coordinator, &launcher); !st.ok()) {
    std::cerr << "meridian launch: " << st.message() << "\n";
    if (const int sig = g_interrupted.load(); sig != 0) return 128 + sig;  // interrupted while starting
    return st.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  if (const int sig = g_interrupted.load(); sig != 0) return interrupted(sig);  // while the sites were started
  for (const auto& site : spec.sites)
    if (!site.ssh)
      std::cout << "  site '" << site.name
                << "' has no ssh: section; start it with: " << JoinCommand(site, certs, coordinator) << "\n";
  std::cout << "launch: " << launcher.Started().size()
            << " executors started; Ctrl-C stops them, or wait for them to finish\n"
            << std::flush;
  for (auto last = std::chrono::steady_clock::now(); !g_interrupted.load();) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    if (std::chrono::steady_clock::now() - last < std::chrono::seconds(5)) continue;
    last = std::chrono::steady_clock::now();
    if (launcher.StillRunning().empty()) {
      std::cout << "launch: every executor has exited\n";
      launcher.StopAll();  // ends the log streams
      return 0;
    }
  }
  return interrupted(g_interrupted.load());
}

}  // namespace meridian::coordinator
