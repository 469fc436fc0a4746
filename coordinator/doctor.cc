#include "coordinator/doctor.h"

#include <iostream>

#include "absl/strings/str_cat.h"
#include "core/certs.h"
#include "core/cluster_spec.h"
#include "core/version.h"
#include "rpc/coordinator_client.h"

namespace meridian::coordinator {

int Doctor(const std::string& cluster_path) {
  auto r = core::LoadSpecFile(cluster_path);
  if (!r.errors.empty()) {
    for (const auto& d : r.errors) std::cerr << d.ToString() << "\n";
    return 2;
  }
  if (!r.spec->cluster) {
    std::cerr << cluster_path << ": error: not a cluster spec (no 'sites')\n";
    return 2;
  }
  const core::ClusterSpec& spec = *r.spec->cluster;
  const std::string certs = core::ResolveRelative(cluster_path, spec.certs_dir);
  int failures = 0;
  auto report = [&](const std::string& what, const absl::Status& s) {
    std::cout << (s.ok() ? "ok    " : "FAIL  ") << what << (s.ok() ? "" : absl::StrCat(": ", s.message())) << "\n";
    failures += !s.ok();
  };
  report(absl::StrCat("spec ", cluster_path, " (cluster '", spec.name, "', ", spec.sites.size(), " sites)"),
         absl::OkStatus());
  std::vector<std::pair<std::string, std::string>> identities = {{"coordinator", spec.coordinator.host}};
  for (const auto& s : spec.sites) identities.push_back({s.name, s.address.host});
  for (const auto& [name, host] : identities) {
    absl::Status s = core::CheckIdentityFiles(certs, name);
    report(absl::StrCat("identity '", name, "' in ", certs), s);
    if (!s.ok()) continue;
    if (name != core::kCoordinatorName) {
      // What the executor will be given, and will refuse if it holds the CA's or another site's key.
      const std::string bundle = core::SiteBundleDir(certs, name);
      report(absl::StrCat("bundle for site '", name, "' in ", bundle), core::CheckSiteBundle(bundle, name));
    }
    // The certificate must name the host it is dialled at (or peers verify by the site name, which
    // every Meridian certificate carries; a foreign certificate might not).
    std::string cmd = absl::StrCat("openssl x509 -noout -checkhost ", host, " -checkip ", host, " -in ", certs, "/",
                                   name, ".pem 2>/dev/null | grep -q 'does match'");
    int rc = std::system(cmd.c_str());
    report(absl::StrCat("certificate '", name, "' covers ", host),
           rc == 0 ? absl::OkStatus()
                   : absl::FailedPreconditionError(absl::StrCat(
                         "it does not name ", host, "; re-issue it with `meridian certs issue --host ", host, "`")));
  }
  // A running coordinator answers a registration from a site only if everything matches: try the first
  // site's identity, without registering (a wrong protocol version is refused before any handler runs).
  if (failures == 0 && !spec.sites.empty()) {
    auto client = rpc::ConnectCoordinator(certs, spec.sites[0].name, spec.coordinator.ToString());
    if (client.ok()) {
      v1::RegisterRequest req;
      req.set_protocol_version(-1);  // never a real version: probes reachability and TLS only
      req.set_site(spec.sites[0].name);
      const absl::Status s = (*client)->Register(req, std::chrono::seconds(3)).status();
      if (s.code() == absl::StatusCode::kFailedPrecondition)
        std::cout << "ok    coordinator at " << spec.coordinator.ToString() << " answers over mutual TLS\n";
      else if (s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kDeadlineExceeded)
        std::cout << "info  no coordinator answers at " << spec.coordinator.ToString()
                  << " yet (start it with `meridian run`)\n";
      else
        report(absl::StrCat("coordinator at ", spec.coordinator.ToString()),
               absl::UnknownError(absl::StrCat("unexpected answer: ", s.message())));
    }
  }
  std::cout << (failures ? absl::StrCat(failures, " check(s) failed") : "all checks passed") << "\n";
  return failures ? 1 : 0;
}

}  // namespace meridian::coordinator
