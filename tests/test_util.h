// Small helpers shared by the integration tests.
#ifndef MERIDIAN_TESTS_TEST_UTIL_H_
#define MERIDIAN_TESTS_TEST_UTIL_H_

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
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

// A loopback TCP port that was free a moment ago, and not handed out before by this process. Picked
// at random below the kernel's ephemeral range (net.ipv4.ip_local_port_range): every outgoing connection
// on the host -- other tests' clients, run by ctest -j beside this one -- takes its local port from that
// range, so a port picked there could be taken between this pick and the server's bind (a CI run failed
// "cannot listen on 127.0.0.1:PORT" so). Below it only another server picking the same port at random
// can collide. Thread-safe.
inline int FreePort() {
  static std::mutex mu;
  static std::set<int> given;
  static std::mt19937 random(std::random_device{}() ^ static_cast<unsigned>(getpid()));
  std::lock_guard<std::mutex> lock(mu);
  int ephemeral_low = 32768;  // Linux's default, when /proc does not say
  if (std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range"); range) range >> ephemeral_low;
  const int low = 10000, high = std::max(low + 1000, ephemeral_low) - 1;
  std::uniform_int_distribution<int> pick(low, high);
  for (;;) {
    const int port = pick(random);
    if (given.count(port)) continue;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    close(fd);
    if (free) {
      given.insert(port);
      return port;
    }
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
