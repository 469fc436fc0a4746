#include "tests/wan/harness.h"

#include <unistd.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace meridian::testing {
namespace {

absl::Status Sh(const std::string& cmd) {
  int rc = std::system((cmd + " >/dev/null 2>&1").c_str());
  if (rc != 0) return absl::InternalError(absl::StrCat("WAN harness: `", cmd, "` failed (", rc, ")"));
  return absl::OkStatus();
}

}  // namespace

bool IsRoot() { return ::geteuid() == 0; }

absl::StatusOr<std::unique_ptr<WanHarness>> WanHarness::Create(const std::vector<std::string>& sites,
                                                               const std::vector<Link>& links) {
  if (!IsRoot()) return absl::FailedPreconditionError("the WAN harness needs root (network namespaces, tc)");
  if (links.size() > 250) return absl::InvalidArgumentError("at most 250 links");
  auto h = std::unique_ptr<WanHarness>(new WanHarness);
  h->prefix_ = absl::StrCat("mrd", ::getpid() % 100000);
  for (const auto& s : sites) {
    std::string ns = absl::StrCat(h->prefix_, "-", s);
    (void)Sh("ip netns del " + ns);  // a leftover from a killed run
    if (auto st = Sh("ip netns add " + ns); !st.ok()) return st;
    h->sites_.push_back(s);
    if (auto st = Sh("ip netns exec " + ns + " ip link set lo up"); !st.ok()) return st;
  }
  for (size_t k = 0; k < links.size(); ++k) {
    const Link& l = links[k];
    std::string va = absl::StrCat("mv", ::getpid() % 100000, "x", k, "a"),
                vb = absl::StrCat("mv", ::getpid() % 100000, "x", k, "b");
    std::string na = absl::StrCat(h->prefix_, "-", l.a), nb = absl::StrCat(h->prefix_, "-", l.b);
    Made m{l.a, l.b, absl::StrCat("10.213.", k + 1, ".1"), absl::StrCat("10.213.", k + 1, ".2")};
    for (const std::string& cmd :
         {absl::StrCat("ip link add ", va, " type veth peer name ", vb),
          absl::StrCat("ip link set ", va, " netns ", na), absl::StrCat("ip link set ", vb, " netns ", nb),
          absl::StrCat("ip netns exec ", na, " ip addr add ", m.addr_a, "/24 dev ", va),
          absl::StrCat("ip netns exec ", nb, " ip addr add ", m.addr_b, "/24 dev ", vb),
          absl::StrCat("ip netns exec ", na, " ip link set ", va, " up"),
          absl::StrCat("ip netns exec ", nb, " ip link set ", vb, " up")}) {
      if (auto st = Sh(cmd); !st.ok()) return st;
    }
    // tbf per direction; burst about 2 ms of traffic (at least 16 KiB), queue up to 200 ms.
    auto shape = [&](const std::string& ns, const std::string& dev, double mbit) -> absl::Status {
      if (mbit <= 0) return absl::OkStatus();
      int burst = std::max(16384, static_cast<int>(mbit * 1e6 / 8 * 0.002));
      return Sh(absl::StrFormat("ip netns exec %s tc qdisc add dev %s root tbf rate %.3fmbit burst %d latency 200ms",
                                ns, dev, mbit, burst));
    };
    if (auto st = shape(na, va, l.mbit_a_to_b); !st.ok()) return st;
    if (auto st = shape(nb, vb, l.mbit_b_to_a); !st.ok()) return st;
    h->links_.push_back(m);
  }
  return h;
}

WanHarness::~WanHarness() {
  for (const auto& s : sites_) (void)Sh(absl::StrCat("ip netns del ", prefix_, "-", s));
}

std::string WanHarness::Exec(const std::string& site) const {
  return absl::StrCat("ip netns exec ", prefix_, "-", site, " ");
}

std::string WanHarness::Address(const std::string& site, const std::string& other) const {
  for (const auto& m : links_) {
    if (m.a == site && m.b == other) return m.addr_a;
    if (m.b == site && m.a == other) return m.addr_b;
  }
  return "";
}

}  // namespace meridian::testing
