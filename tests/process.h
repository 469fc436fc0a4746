// A child process for integration tests: started through /bin/sh, its stdout readable line by line,
// killed and reaped on destruction. Thread-compatible.
#ifndef MERIDIAN_TESTS_PROCESS_H_
#define MERIDIAN_TESTS_PROCESS_H_

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>

namespace meridian::testing {

class Process {
 public:
  // Runs `command` with /bin/sh -c; stderr is inherited (it shows in the test log).
  explicit Process(const std::string& command) {
    int fds[2];
    if (pipe(fds) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      setpgid(0, 0);
      dup2(fds[1], 1);
      close(fds[0]);
      close(fds[1]);
      execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    close(fds[1]);
    out_ = fds[0];
  }
  ~Process() {
    Kill(SIGKILL);
    if (out_ >= 0) close(out_);
  }
  // The next line of stdout, or "" after `timeout` or at EOF.
  std::string ReadLine(std::chrono::milliseconds timeout) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      size_t nl = buf_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return line;
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return "";
      pollfd p{out_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(left.count())) <= 0) return "";
      char chunk[4096];
      ssize_t n = read(out_, chunk, sizeof chunk);
      if (n <= 0) return "";
      buf_.append(chunk, static_cast<size_t>(n));
    }
  }
  // All remaining stdout until EOF or until `timeout` passes without output; a last line without a
  // newline gets one.
  std::string ReadAll(std::chrono::milliseconds timeout) {
    for (;;) {
      pollfd p{out_, POLLIN, 0};
      if (out_ < 0 || poll(&p, 1, static_cast<int>(timeout.count())) <= 0) break;
      char chunk[4096];
      ssize_t n = read(out_, chunk, sizeof chunk);
      if (n <= 0) break;
      buf_.append(chunk, static_cast<size_t>(n));
    }
    std::string all = std::move(buf_);
    buf_.clear();
    if (!all.empty() && all.back() != '\n') all += '\n';
    return all;
  }
  void Kill(int sig) {
    if (pid_ > 0 && !reaped_) {
      ::kill(-pid_, sig);
      if (sig == SIGKILL || sig == SIGTERM) Wait(std::chrono::seconds(10));
    }
  }
  // Waits for exit; returns the exit code, 128+signal, or -1 on timeout.
  int Wait(std::chrono::milliseconds timeout) {
    if (reaped_) return status_;
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      int st = 0;
      if (waitpid(pid_, &st, WNOHANG) == pid_) {
        reaped_ = true;
        status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        return status_;
      }
      usleep(10000);
    }
    return -1;
  }
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  int out_ = -1;
  bool reaped_ = false;
  int status_ = -1;
  std::string buf_;
};

}  // namespace meridian::testing

#endif  // MERIDIAN_TESTS_PROCESS_H_
