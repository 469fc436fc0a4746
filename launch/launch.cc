#include "launch/launch.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/log.h"
#include "core/version.h"

extern char** environ;

namespace meridian::launch {
namespace {

namespace fs = std::filesystem;

std::string Trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

// The last non-empty line of ssh's stderr (its own messages come last), for messages.
std::string LastLine(const std::string& text) {
  std::string t = Trim(text);
  const size_t nl = t.rfind('\n');
  return nl == std::string::npos ? t : t.substr(nl + 1);
}

// Spawns argv with stdin from /dev/null and stdout to a pipe, stderr to a second pipe (`err_fd`) or, when
// `err_fd` is null, to the first; in its own process group. Returns the pid, or -1 with errno set.
pid_t Spawn(const std::vector<std::string>& argv, int* out_fd, int* err_fd) {
  int out[2], err[2] = {-1, -1};
  if (pipe2(out, O_CLOEXEC) != 0) return -1;
  if (err_fd && pipe2(err, O_CLOEXEC) != 0) {
    close(out[0]);
    close(out[1]);
    return -1;
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  posix_spawn_file_actions_adddup2(&fa, err_fd ? err[1] : out[1], 2);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  posix_spawnattr_setpgroup(&attr, 0);
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &all);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawnp(&pid, args[0], &fa, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  close(out[1]);
  if (err_fd) close(err[1]);
  if (rc != 0) {
    close(out[0]);
    if (err_fd) close(err[0]);
    errno = rc;
    return -1;
  }
  *out_fd = out[0];
  if (err_fd) *err_fd = err[0];
  return pid;
}

int WaitExit(pid_t pid) {
  int st = 0;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

// "user@host" (or "host": ssh's own user), as ssh and scp take it.
std::string Login(const core::SshSpec& ssh) { return absl::StrCat(ssh.user.empty() ? "" : ssh.user + "@", ssh.host); }

std::string Destination(const core::SshSpec& ssh) { return absl::StrCat(Login(ssh), ":", ssh.port); }

// The files of a site's certificate bundle that go to it (core::SiteBundleDir; never the CA's key).
std::vector<std::string> BundleFiles(const std::string& site) { return {"ca.pem", site + ".pem", site + ".key"}; }

// How known_hosts names the host: "host" on port 22, "[host]:port" elsewhere.
std::string KnownHostsName(const core::SshSpec& ssh) {
  return ssh.port == 22 ? ssh.host : absl::StrCat("[", ssh.host, "]:", ssh.port);
}

std::string KnownHostsFile(const core::SshSpec& ssh) {
  if (!ssh.known_hosts.empty()) return ssh.known_hosts;
  const char* home = std::getenv("HOME");
  return absl::StrCat(home ? home : "", "/.ssh/known_hosts");
}

// ssh's options for BatchMode logins checked against known_hosts (scp takes the same, with -P).
std::vector<std::string> CommonOptions(const core::SshSpec& ssh, const LaunchOptions& o) {
  std::vector<std::string> a = {
      "-o", "BatchMode=yes",
      "-o", absl::StrCat("ConnectTimeout=", o.connect_timeout_seconds),
      "-o", "ServerAliveInterval=5",
      "-o", "ServerAliveCountMax=3",
      "-o", o.accept_new_host_keys ? "StrictHostKeyChecking=accept-new" : "StrictHostKeyChecking=yes",
      "-o", "LogLevel=ERROR"};
  if (!ssh.known_hosts.empty()) {
    a.insert(a.end(), {"-o", "UserKnownHostsFile=" + ssh.known_hosts, "-o", "GlobalKnownHostsFile=/dev/null"});
  }
  if (!ssh.identity_file.empty()) a.insert(a.end(), {"-o", "IdentitiesOnly=yes", "-i", ssh.identity_file});
  return a;
}

// A site's own folder under the workdir (sites may share a host and a workdir): WORKDIR/SITE.
std::string SiteDir(const SiteLaunch& s) { return s.ssh.workdir + "/" + s.site; }
std::string Remote(const SiteLaunch& s, const std::string& path) { return ShellQuote(SiteDir(s) + "/" + path); }

}  // namespace

std::string ShellQuote(std::string_view v) {
  std::string out = "'";
  for (char c : v) {
    if (c == '\'')
      out += "'\\''";
    else
      out += c;
  }
  return out + "'";
}

std::vector<std::string> SshArgv(const core::SshSpec& ssh, const LaunchOptions& o, const std::string& remote_command) {
  std::vector<std::string> a = {"ssh"};
  for (auto& opt : CommonOptions(ssh, o)) a.push_back(std::move(opt));
  a.insert(a.end(), {"-p", std::to_string(ssh.port)});
  if (!ssh.user.empty()) a.insert(a.end(), {"-l", ssh.user});
  a.push_back(ssh.host);  // the loader refused hosts that start with '-'
  a.push_back(remote_command);
  return a;
}

std::string ExplainSshFailure(const core::SshSpec& ssh, const std::string& e) {
  const std::string where = Destination(ssh);
  if (e.find("REMOTE HOST IDENTIFICATION HAS CHANGED") != std::string::npos)
    return absl::StrCat("the host key of ", where, " is not the one recorded in ", KnownHostsFile(ssh),
                        ": someone may be intercepting the connection; if the host was really reinstalled, remove "
                        "the old key with `ssh-keygen -R ",
                        KnownHostsName(ssh), " -f ", KnownHostsFile(ssh), "`");
  if (e.find("Host key verification failed") != std::string::npos ||
      e.find("No ED25519 host key is known") != std::string::npos || e.find("host key is known") != std::string::npos)
    return absl::StrCat("the host key of ", where, " is not in ", KnownHostsFile(ssh),
                        ": check the host's key and add it (ssh-keyscan), or pass --accept-new-host-keys on first "
                        "contact");
  if (e.find("Permission denied") != std::string::npos)
    return absl::StrCat(where, " refused the key ",
                        ssh.identity_file.empty() ? std::string("(ssh's default keys)") : ssh.identity_file,
                        ": add its .pub to the remote user's ~/.ssh/authorized_keys, or set ssh.identity_file");
  for (const char* unreachable :
       {"Connection refused", "timed out", "No route to host", "Could not resolve hostname", "Network is unreachable"})
    if (e.find(unreachable) != std::string::npos)
      return absl::StrCat("cannot reach ", where, " (", LastLine(e),
                          "): is sshd running there, and the host and "
                          "ssh.port right?");
  return "";
}

bool IsProblemLine(std::string_view line) {
  std::string l(line);
  std::transform(l.begin(), l.end(), l.begin(), [](unsigned char c) { return std::tolower(c); });
  for (const char* word : {"error", "warn", "fail", "fatal", "abort", "exception", "terminate"})
    if (l.find(word) != std::string::npos) return true;
  return false;
}

CommandResult RunCommand(const std::vector<std::string>& argv, std::chrono::milliseconds timeout) {
  CommandResult r;
  int out = -1, err = -1;
  const pid_t pid = Spawn(argv, &out, &err);
  if (pid < 0) {
    r.err = absl::StrCat("cannot run ", argv[0], " here: ", std::strerror(errno));
    r.spawn_failed = true;
    return r;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool timed_out = false;
  std::vector<pollfd> fds = {{out, POLLIN, 0}, {err, POLLIN, 0}};
  while (fds[0].fd >= 0 || fds[1].fd >= 0) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) {
      timed_out = true;
      break;
    }
    if (poll(fds.data(), fds.size(), static_cast<int>(left)) < 0 && errno != EINTR) break;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[4096];
      const ssize_t n = read(fds[i].fd, buf, sizeof buf);
      if (n > 0) {
        (i == 0 ? r.out : r.err).append(buf, static_cast<size_t>(n));
        if (r.out.size() + r.err.size() > (size_t{16} << 20)) r.too_much_output = true;  // not what we asked for
      } else if (n == 0 || errno != EINTR) {
        close(fds[i].fd);
        fds[i].fd = -1;
      }
    }
    if (timed_out || r.too_much_output) break;
  }
  for (const auto& f : fds)
    if (f.fd >= 0) close(f.fd);
  if (timed_out || r.too_much_output) kill(-pid, SIGKILL);
  r.exit_code = WaitExit(pid);
  if (timed_out) r.exit_code = -1;
  return r;
}

SshLauncher::SshLauncher(LaunchOptions options, LogSink on_problem, Say say)
    : options_(std::move(options)), on_problem_(std::move(on_problem)), say_(std::move(say)) {}

SshLauncher::~SshLauncher() { StopAll(); }

std::string SshLauncher::Who(const SiteLaunch& s) {
  return absl::StrCat("site '", s.site, "' (", Destination(s.ssh), ")");
}

std::chrono::seconds SshLauncher::Limit() const { return std::chrono::seconds(options_.connect_timeout_seconds + 30); }

absl::Status SshLauncher::SshFailed(const SiteLaunch& s, const CommandResult& r, const std::string& doing) const {
  const std::string who = Who(s);
  if (r.spawn_failed) return absl::FailedPreconditionError(absl::StrCat(who, ": ", r.err));
  if (r.too_much_output)
    return absl::UnavailableError(absl::StrCat(who, ": ", doing, " printed more than 16 MiB; stopped"));
  if (r.exit_code == -1)
    return absl::DeadlineExceededError(absl::StrCat(who, ": ", doing, " took longer than ", Limit().count(), " s"));
  // 255 is ssh's own failure (login, host key, network); any other code is the remote command's.
  std::string why = r.exit_code == 255 ? ExplainSshFailure(s.ssh, r.err) : "";
  if (why.empty())
    why = absl::StrCat(doing, " failed (exit ", r.exit_code, "): ", core::Printable(LastLine(r.err + "\n" + r.out)));
  return absl::UnavailableError(absl::StrCat(who, ": ", why));
}

absl::Status SshLauncher::Launch(const SiteLaunch& s) {
  if (absl::Status st = Check(s); !st.ok()) return st;
  return Start(s);
}

absl::Status SshLauncher::Check(const SiteLaunch& s) {
  const core::SshSpec& ssh = s.ssh;
  const std::string who = Who(s);
  const auto limit = Limit();
  for (const auto& f : BundleFiles(s.site))
    if (!fs::is_regular_file(fs::path(s.bundle_dir) / f))
      return absl::FailedPreconditionError(absl::StrCat(who, ": the site's certificate bundle ", s.bundle_dir,
                                                        " has no ", f, " (create it with `meridian certs init`)"));
  // 1 and 2: log in, and ask the executor there for its version.
  const bool known =
      RunCommand({"ssh-keygen", "-F", KnownHostsName(ssh), "-f", KnownHostsFile(ssh)}, std::chrono::seconds(10))
          .exit_code == 0;
  CommandResult v = RunCommand(SshArgv(ssh, options_, ShellQuote(ssh.executor) + " --version"), limit);
  if (v.exit_code == 255 || v.exit_code == -1 || v.spawn_failed || v.too_much_output)
    return SshFailed(s, v, "logging in");
  if (v.exit_code == 127)
    return absl::FailedPreconditionError(absl::StrCat(who, ": no executor at '", ssh.executor, "' there (",
                                                      LastLine(v.err),
                                                      "): install meridian-executor or set ssh.executor to its path"));
  const std::string want = absl::StrCat("meridian-executor ", meridian::kVersion);
  const std::string got = Trim(v.out);
  if (v.exit_code != 0 || got != want)
    return absl::FailedPreconditionError(absl::StrCat(
        who, ": '", ssh.executor, " --version' there says '", got.empty() ? LastLine(v.err) : got,
        "', but this coordinator is ", want, ": install the same version there (or point ssh.executor ", "at it)"));
  if (!known && options_.accept_new_host_keys) {
    CommandResult fp = RunCommand({"ssh-keygen", "-l", "-F", KnownHostsName(ssh), "-f", KnownHostsFile(ssh)},
                                  std::chrono::seconds(10));
    std::string key;
    for (const auto& line : absl::StrSplit(fp.out, '\n'))
      if (!line.empty() && line[0] != '#') key = Trim(std::string(line));
    say_(s.site, absl::StrCat("accepted the new host key of ", Destination(ssh), " into ", KnownHostsFile(ssh), ": ",
                              key.empty() ? "(not found there)" : key));
  }
  return absl::OkStatus();
}

absl::Status SshLauncher::Start(const SiteLaunch& s) {
  const core::SshSpec& ssh = s.ssh;
  const auto limit = Limit();
  // 3: the site's own bundle, and nothing else.
  // The site's own folder, WORKDIR/SITE, readable by the login alone (the workdir itself is left as it is).
  CommandResult mk = RunCommand(SshArgv(ssh, options_,
                                        absl::StrCat("mkdir -p ", Remote(s, "certs"), " && chmod 700 ",
                                                     ShellQuote(SiteDir(s)), " ", Remote(s, "certs"))),
                                limit);
  if (mk.exit_code != 0) return SshFailed(s, mk, absl::StrCat("creating ", SiteDir(s), "/certs"));
  std::vector<std::string> scp = {"scp", "-q"};
  for (auto& opt : CommonOptions(ssh, options_)) scp.push_back(std::move(opt));
  scp.insert(scp.end(), {"-P", std::to_string(ssh.port)});
  for (const auto& f : BundleFiles(s.site)) scp.push_back((fs::path(s.bundle_dir) / f).string());
  scp.push_back(absl::StrCat(Login(ssh), ":", SiteDir(s), "/certs/"));
  CommandResult cp = RunCommand(scp, limit);
  if (cp.exit_code != 0) return SshFailed(s, cp, "copying the certificate bundle (scp)");
  // 4: the executor, detached; its pid comes back.
  std::string start = absl::StrCat(
      "chmod 600 ", Remote(s, "certs/" + s.site + ".key"), " && { nohup ", ShellQuote(ssh.executor), " --coordinator ",
      ShellQuote(s.coordinator), " --site ", ShellQuote(s.site), " --certs ", Remote(s, "certs"), " --listen ",
      ShellQuote(s.listen), " --device ", ShellQuote(s.device),
      options_.executor_log_level.empty() ? "" : " --log-level " + ShellQuote(options_.executor_log_level), " > ",
      Remote(s, "executor.log"), " 2>&1 < /dev/null & echo $! > ", Remote(s, "executor.pid"), "; echo $!; }");
  CommandResult started = RunCommand(SshArgv(ssh, options_, start), limit);
  const std::string pid = Trim(started.out);
  if (started.exit_code != 0 || pid.empty() || pid.find_first_not_of("0123456789") != std::string::npos)
    return SshFailed(s, started, "starting the executor");
  auto st = std::make_unique<Started_>();
  st->site = s;
  st->pid = pid;
  // 5: follow the log; problems go to the sink.
  int out = -1;
  // (--pid: the remote tail ends with the executor, even if this side's ssh went first.)
  st->tail = Spawn(
      SshArgv(ssh, options_, absl::StrCat("tail --pid=", pid, " -n +1 -F ", Remote(s, "executor.log"), " 2>/dev/null")),
      &out, nullptr);
  if (st->tail > 0)
    st->reader = std::thread([this, out, site = s.site] {
      std::string buf;
      char chunk[4096];
      for (ssize_t n; (n = read(out, chunk, sizeof chunk)) != 0;) {
        if (n < 0) {
          if (errno == EINTR) continue;
          break;
        }
        buf.append(chunk, static_cast<size_t>(n));
        for (size_t nl; (nl = buf.find('\n')) != std::string::npos; buf.erase(0, nl + 1)) {
          const std::string line = buf.substr(0, nl);
          if (IsProblemLine(line)) on_problem_(site, core::Printable(line));
        }
        if (buf.size() > 65536) {  // a "line" that never ends: report its start, drop the rest
          if (IsProblemLine(buf)) on_problem_(site, core::Printable(buf));
          buf.clear();
        }
      }
      close(out);
    });
  say_(s.site, absl::StrCat("started meridian-executor (pid ", pid, ") at ", Destination(ssh), ", log in ", SiteDir(s),
                            "/executor.log there"));
  std::lock_guard<std::mutex> l(mu_);
  started_.push_back(std::move(st));
  return absl::OkStatus();
}

std::vector<std::string> SshLauncher::Started() const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<std::string> out;
  for (const auto& s : started_) out.push_back(s->site.site);
  return out;
}

std::vector<std::string> SshLauncher::StillRunning() const {
  std::vector<std::pair<std::string, std::vector<std::string>>> asks;
  {
    std::lock_guard<std::mutex> l(mu_);
    for (const auto& s : started_)
      asks.push_back({s->site.site, SshArgv(s->site.ssh, options_, "kill -0 " + s->pid + " 2>/dev/null")});
  }
  std::vector<std::string> out;
  for (const auto& [site, argv] : asks) {
    const int rc = RunCommand(argv, std::chrono::seconds(options_.connect_timeout_seconds + 10)).exit_code;
    if (rc != 1) out.push_back(site);  // 0: running; 255 or a timeout: cannot tell
  }
  return out;
}

void SshLauncher::StopAll() {
  std::vector<std::unique_ptr<Started_>> all;
  {
    std::lock_guard<std::mutex> l(mu_);
    all.swap(started_);
  }
  if (all.empty()) return;
  // Every site at once: SIGTERM, up to 5 s to exit, then SIGKILL.
  std::vector<std::thread> stops;
  for (const auto& s : all)
    stops.emplace_back([this, &s] {
      const std::string p = s->pid;
      const std::string cmd =
          absl::StrCat("kill -TERM ", p, " 2>/dev/null; i=0; while kill -0 ", p, " 2>/dev/null && [ $i -lt 50 ]; do ",
                       "sleep 0.1; i=$((i+1)); done; kill -KILL ", p, " 2>/dev/null; true");
      CommandResult r =
          RunCommand(SshArgv(s->site.ssh, options_, cmd), std::chrono::seconds(options_.connect_timeout_seconds + 20));
      say_(s->site.site, r.exit_code == 0 ? absl::StrCat("stopped meridian-executor (pid ", p, ")")
                                          : absl::StrCat("could not stop meridian-executor (pid ", p, "): ",
                                                         ExplainSshFailure(s->site.ssh, r.err).empty()
                                                             ? LastLine(r.err)
                                                             : ExplainSshFailure(s->site.ssh, r.err)));
    });
  for (auto& t : stops) t.join();
  for (auto& s : all) {
    if (s->tail > 0) {
      kill(-s->tail, SIGTERM);
      WaitExit(s->tail);
    }
    if (s->reader.joinable()) s->reader.join();
  }
}

}  // namespace meridian::launch
