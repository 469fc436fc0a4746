// A WAN emulation harness for tests and benchmarks: each site in its own network namespace, each link
// a veth pair with tbf rate limits per direction; latency comes from meridian-wanrelay processes that
// the caller starts inside the namespaces (netem does not exist on our machines). Only addresses in
// 10.213.0.0/16 inside the namespaces this harness creates are used. Needs root: Create() fails
// otherwise, and tests skip with a clear message (IsRoot()).
// Thread-compatible. The destructor deletes everything the harness created.
#ifndef MERIDIAN_TESTS_WAN_HARNESS_H_
#define MERIDIAN_TESTS_WAN_HARNESS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace meridian::testing {

bool IsRoot();

class WanHarness {
 public:
  struct Link {
    std::string a, b;
    double mbit_a_to_b = 0;  // tbf rate of a -> b in Mbit/s; 0 = unlimited
    double mbit_b_to_a = 0;
  };
  static absl::StatusOr<std::unique_ptr<WanHarness>> Create(const std::vector<std::string>& sites,
                                                            const std::vector<Link>& links);
  ~WanHarness();
  WanHarness(const WanHarness&) = delete;
  WanHarness& operator=(const WanHarness&) = delete;

  // "ip netns exec NS" for the site, to prefix a command with.
  std::string Exec(const std::string& site) const;
  // The address of `site` on its link with `other` (reachable from `other`'s namespace).
  std::string Address(const std::string& site, const std::string& other) const;

 private:
  WanHarness() = default;
  struct Made {
    std::string a, b, addr_a, addr_b;
  };
  std::string prefix_;
  std::vector<std::string> sites_;
  std::vector<Made> links_;
};

}  // namespace meridian::testing

#endif  // MERIDIAN_TESTS_WAN_HARNESS_H_
