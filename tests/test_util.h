// Small helpers shared by the integration tests.
#ifndef MERIDIAN_TESTS_TEST_UTIL_H_
#define MERIDIAN_TESTS_TEST_UTIL_H_

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "core/safetensors.h"

namespace meridian::testing {

// Runs `cmd` under /bin/sh, stderr joined to stdout; its exit status (-1 if it did not exit) and output.
inline std::pair<int, std::string> Shell(const std::string& cmd) {
  std::string out;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  std::array<char, 4096> buf;
  while (p && fgets(buf.data(), buf.size(), p)) out += buf.data();
  int rc = p ? pclose(p) : -1;
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, out};
}

// A built binary of this tree (build/bin/NAME).
inline std::string Bin(const std::string& name) { return std::string(MERIDIAN_TEST_BINARY_DIR) + "/bin/" + name; }

// A loopback TCP port that was free a moment ago, and not handed out before by this process (the kernel
// may give a just-closed port again; servers no longer share a port, so a duplicate would fail to bind).
inline int FreePort() {
  static std::mutex mu;
  static std::set<int> given;
  std::lock_guard<std::mutex> lock(mu);
  for (;;) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    socklen_t len = sizeof a;
    getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    close(fd);
    if (given.insert(ntohs(a.sin_port)).second) return ntohs(a.sin_port);
  }
}

// ||a - b|| / ||b|| of two float32 tensors of the same size.
inline double RelativeL2(const core::Tensor& a, const core::Tensor& b) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < b.numel(); ++i) {
    double x = a.data<float>()[i], y = b.data<float>()[i];
    num += (x - y) * (x - y);
    den += y * y;
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// The model tensors (not optimizer state) of every .safetensors shard in `dir`, merged by name.
inline std::map<std::string, core::Tensor> MergeShards(const std::filesystem::path& dir) {
  std::map<std::string, core::Tensor> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() != ".safetensors") continue;
    auto f = core::ReadSafetensors(e.path().string());
    if (!f.ok()) continue;
    for (auto& [k, v] : f->tensors)
      if (k.rfind("optim.", 0) != 0) out[k] = std::move(v);
  }
  return out;
}

}  // namespace meridian::testing

#endif  // MERIDIAN_TESTS_TEST_UTIL_H_
