#include "coordinator/doctor.h"

#include <grpcpp/grpcpp.h>

#include <iostream>

#include "absl/strings/str_cat.h"
#include "core/certs.h"
#include "core/cluster_spec.h"
#include "core/version.h"
#include "proto/meridian.grpc.pb.h"
#include "rpc/credentials.h"

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
    // The certificate must name the host it is dialled at (or peers verify by the site name, which
    // every Meridian certificate carries; a foreign certificate might not).
    std::string cmd = absl::StrCat("openssl x509 -noout -checkhost ", host, " -checkip ", host, " -in ", certs, "/",
                                   name, ".pem 2>/dev/null | grep -q 'does match'");
    int rc = std::system(cmd.c_str());
    report(absl::StrCat("certificate '", name, "' covers ", host),
           rc == 0 ? absl::OkStatus()
                   : absl::FailedPreconditionError(absl::StrCat("it does not name ", host,
                                                                "; re-issue it with `meridian certs issue --host ", host, "`")));
  }
  // A running coordinator answers a registration from a site only if everything matches: try the first
  // site's identity, without registering (a wrong protocol version is refused before any handler runs).
  if (failures == 0 && !spec.sites.empty()) {
    auto creds = rpc::MakeChannelCredentials(certs, spec.sites[0].name);
    if (creds.ok()) {
      auto stub = v1::Coordinator::NewStub(
          grpc::CreateCustomChannel(spec.coordinator.ToString(), *creds, rpc::PeerChannelArguments("coordinator")));
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
      v1::RegisterRequest req;
      req.set_protocol_version(-1);  // never a real version: probes reachability and TLS only
      req.set_site(spec.sites[0].name);
      v1::RegisterResponse resp;
      grpc::Status s = stub->Register(&ctx, req, &resp);
      if (s.error_code() == grpc::StatusCode::FAILED_PRECONDITION)
        std::cout << "ok    coordinator at " << spec.coordinator.ToString() << " answers over mutual TLS\n";
      else if (s.error_code() == grpc::StatusCode::UNAVAILABLE || s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
        std::cout << "info  no coordinator answers at " << spec.coordinator.ToString()
                  << " yet (start it with `meridian run`)\n";
      else
        report(absl::StrCat("coordinator at ", spec.coordinator.ToString()),
               absl::UnknownError(absl::StrCat("unexpected answer: ", s.error_message())));
    }
  }
  std::cout << (failures ? absl::StrCat(failures, " check(s) failed") : "all checks passed") << "\n";
  return failures ? 1 : 0;
}

}  // namespace meridian::coordinator
