// Starting the executors of remote sites over SSH: what `meridian launch CLUSTER --coordinator ADDR` and
// `meridian run CLUSTER JOB --launch ssh` do for every site whose spec has `ssh:` (core::SshSpec).
// OpenSSH's own `ssh` and `scp` binaries do the work, never a shell of ours: each runs from an argument
// vector, in its own process group (a Ctrl-C at the terminal reaches only `meridian`, which then stops the
// sites itself). For one site, Check does steps 1 and 2 (nothing is copied or started), Start steps 3 to 5,
// and Launch all five:
//   1. logs in (BatchMode: keys only; host keys checked against known_hosts, or with
//      accept_new_host_keys recorded there on first contact, and then said which key was accepted);
//   2. checks that the remote `meridian-executor --version` is this build's version;
//   3. copies the site's own certificate bundle (ca.pem, SITE.pem, SITE.key: never the CA's key or
//      another site's) into WORKDIR/SITE/certs, the folder and the key readable by the login only (each
//      site has its own folder: sites may share a host and a workdir);
//   4. starts the executor detached (nohup), its log in WORKDIR/SITE/executor.log and pid in
//      WORKDIR/SITE/executor.pid;
//   5. follows that log (`tail -F` over a second ssh, ending with the executor) and hands every line
//      that reports a problem (an error, a warning, a failure) to the LogSink, control characters
//      escaped and at most 4000 bytes.
// StopAll (and the destructor) send SIGTERM to every executor started, SIGKILL 5 s later if it is still
// there, and end the log streams. docs/launch.md describes the setup.
//
// A caller starting several sites checks them all first (LaunchSshSites in coordinator/ does, in
// parallel), so that a refused key, an unknown host or another version fails within one login and starts
// nothing anywhere.
//
// Thread-safe: Check, Start and Launch may run for several sites at once (one thread each); StopAll may
// be called from any thread, once those calls returned. The LogSink is called from the log threads.
#ifndef MERIDIAN_LAUNCH_LAUNCH_H_
#define MERIDIAN_LAUNCH_LAUNCH_H_

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/cluster_spec.h"

namespace meridian::launch {

// One site to start.
struct SiteLaunch {
  std::string site;         // the spec's name (the certificate CN)
  core::SshSpec ssh;        // identity_file and known_hosts already resolved
  std::string bundle_dir;   // local: the site's bundle (core::SiteBundleDir): ca.pem, SITE.pem, SITE.key
  std::string coordinator;  // HOST:PORT the executor joins
  std::string listen;       // the site's address in the spec
  std::string device;       // its first device
};

struct LaunchOptions {
  bool accept_new_host_keys = false;
  int connect_timeout_seconds = 8;  // ssh's ConnectTimeout: an unreachable host fails within it
  std::string executor_log_level;   // "": the executor's default
};

// Called with (site, line) for each problem line of a site's executor log.
using LogSink = std::function<void(const std::string& site, const std::string& line)>;
// Called with (site, message) for what the launcher did or accepted (started, a new host key).
using Say = std::function<void(const std::string& site, const std::string& message)>;

struct CommandResult;

class SshLauncher {
 public:
  SshLauncher(LaunchOptions options, LogSink on_problem, Say say);
  ~SshLauncher();  // StopAll()
  SshLauncher(const SshLauncher&) = delete;
  SshLauncher& operator=(const SshLauncher&) = delete;

  // Steps 1-2 above for one site: it can be logged into and runs this version's executor. Errors name
  // the site and the host, say what went wrong and how to fix it (an unknown host key, a refused key, an
  // unreachable host, a missing or mismatched executor, a missing certificate bundle).
  absl::Status Check(const SiteLaunch& s);
  // Steps 3-5 for a site that Check accepted; errors as Check's.
  absl::Status Start(const SiteLaunch& s);
  // Check, then Start.
  absl::Status Launch(const SiteLaunch& s);
  // Every site started and not stopped, by name.
  std::vector<std::string> Started() const;
  // Whether each started site's executor still runs (one `kill -0` over ssh each); a site that cannot
  // be asked counts as running.
  std::vector<std::string> StillRunning() const;
  // Stops every executor started (SIGTERM; SIGKILL after 5 s), ends the log streams. Idempotent.
  void StopAll();

 private:
  struct Started_ {
    SiteLaunch site;
    std::string pid;  // the remote executor's
    pid_t tail = -1;  // the local ssh following its log
    std::thread reader;
  };
  static std::string Who(const SiteLaunch& s);  // "site 'a' (user@host:22)"
  std::chrono::seconds Limit() const;           // for one ssh or scp command
  // The error for a failed ssh or scp command `doing` something at site s.
  absl::Status SshFailed(const SiteLaunch& s, const CommandResult& r, const std::string& doing) const;

  LaunchOptions options_;
  LogSink on_problem_;
  Say say_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Started_>> started_;
};

// ---- The pieces, for tests and messages. ----

// `v` quoted for a POSIX shell: 'v', with each ' written as '\''.
std::string ShellQuote(std::string_view v);
// ssh's argument vector to run `remote_command` (one string, interpreted by the remote shell) at the
// site: BatchMode, ConnectTimeout, StrictHostKeyChecking (yes, or accept-new), the spec's port, user,
// identity (IdentitiesOnly) and known_hosts.
std::vector<std::string> SshArgv(const core::SshSpec& ssh, const LaunchOptions& o, const std::string& remote_command);
// What a failed ssh login's stderr means, in a sentence that says what to do (host key unknown or
// changed, key refused, host unreachable); "" when it is none of those.
std::string ExplainSshFailure(const core::SshSpec& ssh, const std::string& stderr_text);
// Whether a line of the executor's log reports a problem (error, warning, failure, fatal, abort).
bool IsProblemLine(std::string_view line);

// The result of a local command run from an argument vector, stdin from /dev/null.
struct CommandResult {
  int exit_code = -1;  // or 128 + the signal; -1 when it timed out (it was killed)
  std::string out, err;
  bool spawn_failed = false;     // the binary could not be run here (`err` says why)
  bool too_much_output = false;  // more than 16 MiB: it was killed
};
// Runs `argv` (argv[0] found on PATH) in its own process group; kills it after `timeout`.
CommandResult RunCommand(const std::vector<std::string>& argv, std::chrono::milliseconds timeout);

}  // namespace meridian::launch

#endif  // MERIDIAN_LAUNCH_LAUNCH_H_
