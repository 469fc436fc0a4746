#include "dashboard/dashboard.h"

#include <cstddef>

namespace meridian::dashboard {
namespace assets {  // build/dashboard/assets.cc, written by cmake/Embed.cmake
extern const unsigned char kIndexHtml[], kDashboardJs[], kDashboardCss[], kChartJs[];
extern const size_t kIndexHtml_size, kDashboardJs_size, kDashboardCss_size, kChartJs_size;
}  // namespace assets

namespace {
std::string_view View(const unsigned char* bytes, size_t size) {
  return std::string_view(reinterpret_cast<const char*>(bytes), size);
}
}  // namespace

const std::vector<Asset>& Assets() {
  static const std::vector<Asset> all = {
      {"/", "text/html; charset=utf-8", View(assets::kIndexHtml, assets::kIndexHtml_size)},
      {"/dashboard.js", "text/javascript; charset=utf-8", View(assets::kDashboardJs, assets::kDashboardJs_size)},
      {"/dashboard.css", "text/css; charset=utf-8", View(assets::kDashboardCss, assets::kDashboardCss_size)},
      {"/chart.min.js", "text/javascript; charset=utf-8", View(assets::kChartJs, assets::kChartJs_size)},
  };
  return all;
}

std::optional<Asset> FindAsset(std::string_view path) {
  if (path == "/index.html") path = "/";
  for (const Asset& a : Assets())
    if (a.path == path) return a;
  return std::nullopt;
}

}  // namespace meridian::dashboard
