#include "executor/options.h"

#include "absl/strings/str_cat.h"
#include "core/certs.h"
#include "core/cluster_spec.h"

namespace meridian::executor {

absl::StatusOr<ExecutorOptions> ResolveOptions(const ExecutorFlags& flags,
                                               const std::function<std::optional<std::string>(const char*)>& getenv) {
  auto pick = [&](const std::optional<std::string>& flag, const char* env,
                  std::string* source) -> std::optional<std::string> {
    if (flag) {
      *source = "flag";
      return flag;
    }
    if (auto v = getenv(env)) {
      *source = absl::StrCat("$", env);
      return v;
    }
    return std::nullopt;
  };
  std::string src;
  std::optional<core::SpecFile> spec;
  if (auto spec_path = pick(flags.spec, "MERIDIAN_SPEC", &src)) {
    auto r = core::LoadSpecFile(*spec_path);
    if (!r.errors.empty()) return absl::InvalidArgumentError(r.errors.front().ToString());
    spec = std::move(r.spec);
  }
  const core::ClusterSpec* cluster = spec && spec->cluster ? &*spec->cluster : nullptr;
  ExecutorOptions o;
  std::string site_src = "spec";
  if (auto v = pick(flags.site, "MERIDIAN_SITE", &site_src)) o.site = *v;
  if (o.site.empty()) return absl::InvalidArgumentError("no site name: pass --site NAME (or set MERIDIAN_SITE)");
  const core::SiteSpec* site = cluster ? cluster->FindSite(o.site) : nullptr;
  if (cluster && !site)
    return absl::InvalidArgumentError(
        absl::StrCat("site '", o.site, "' (from ", site_src, ") is not in the spec ", spec->path));
  std::string coord_src = "spec";
  if (auto v = pick(flags.coordinator, "MERIDIAN_COORDINATOR", &coord_src))
    o.coordinator = *v;
  else if (cluster)
    o.coordinator = cluster->coordinator.ToString();
  if (o.coordinator.empty()) return absl::InvalidArgumentError("no coordinator address: pass --coordinator HOST:PORT");
  core::Endpoint ep;
  std::string err;
  if (!core::ParseEndpoint(o.coordinator, &ep, &err))
    return absl::InvalidArgumentError(absl::StrCat("coordinator address (from ", coord_src, "): ", err));
  std::string certs_src = "spec";
  if (auto v = pick(flags.certs, "MERIDIAN_CERTS", &certs_src))
    o.certs = *v;
  else if (cluster)
    o.certs = core::SiteBundleDir(core::ResolveRelative(spec->path, cluster->certs_dir), o.site);
  if (o.certs.empty()) return absl::InvalidArgumentError("no certificate directory: pass --certs DIR");
  std::string listen_src = "spec";
  if (auto v = pick(flags.listen, "MERIDIAN_LISTEN", &listen_src))
    o.listen = *v;
  else if (site)
    o.listen = site->address.ToString();
  if (o.listen.empty()) o.listen = "0.0.0.0:7401";
  if (!core::ParseEndpoint(o.listen, &ep, &err))
    return absl::InvalidArgumentError(absl::StrCat("listen address (from ", listen_src, "): ", err));
  std::string dev_src = "default";
  if (auto v = pick(flags.device, "MERIDIAN_DEVICE", &dev_src))
    o.device = *v;
  else if (site && !site->devices.empty())
    o.device = site->devices.front();
  bool dev_ok = o.device == "cpu";
  if (o.device.rfind("cuda:", 0) == 0 && o.device.size() > 5)
    dev_ok = o.device.find_first_not_of("0123456789", 5) == std::string::npos;
  if (!dev_ok)
    return absl::InvalidArgumentError(
        absl::StrCat("device '", o.device, "' (from ", dev_src, ") is not cpu or cuda:N"));
  return o;
}

}  // namespace meridian::executor
