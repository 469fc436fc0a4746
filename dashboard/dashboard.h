// The run's web page, served by `meridian run` at http://HOST:PORT/ beside /metrics (coordinator/run.cc):
// the plan as a diagram, every site's health, live charts of loss, tokens/s and WAN bytes, and the run's
// events. The page is static; it reads the run from /api/run (Coordinator::RunJson, documented in
// docs/coordinator.md) every two seconds. Its assets, Chart.js included (Debian's libjs-chart.js), are
// compiled into the binary: nothing is fetched from elsewhere.
//
// Pure and thread-safe: the assets are constants.
#ifndef MERIDIAN_DASHBOARD_DASHBOARD_H_
#define MERIDIAN_DASHBOARD_DASHBOARD_H_

#include <optional>
#include <string_view>
#include <vector>

namespace meridian::dashboard {

struct Asset {
  std::string_view path;  // as served: "/", "/dashboard.js", "/dashboard.css", "/chart.min.js"
  std::string_view mime;  // its Content-Type
  std::string_view body;
};

// Every asset of the page.
const std::vector<Asset>& Assets();
// The asset served at `path` ("/index.html" is "/"); nullopt for any other path.
std::optional<Asset> FindAsset(std::string_view path);

// The Content-Security-Policy the page is served with: scripts, styles and data from the server itself
// only, no inline script, no frames.
inline constexpr char kContentSecurityPolicy[] =
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

}  // namespace meridian::dashboard

#endif  // MERIDIAN_DASHBOARD_DASHBOARD_H_
