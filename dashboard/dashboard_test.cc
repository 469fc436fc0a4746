#include "dashboard/dashboard.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <regex>
#include <string>

namespace meridian::dashboard {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(Dashboard, ServesThePageItsScriptsAndChartJsFromTheBinary) {
  for (const char* path : {"/", "/index.html", "/dashboard.js", "/dashboard.css", "/chart.min.js"}) {
    auto a = FindAsset(path);
    ASSERT_TRUE(a.has_value()) << path;
    EXPECT_GT(a->body.size(), 100u) << path;
  }
  EXPECT_FALSE(FindAsset("/etc/passwd").has_value());
  EXPECT_FALSE(FindAsset("/../dashboard.js").has_value());
  // Chart.js itself (Debian's libjs-chart.js, version 3), not a placeholder.
  EXPECT_THAT(std::string(FindAsset("/chart.min.js")->body), HasSubstr("Chart.js v3."));
  EXPECT_THAT(std::string(FindAsset("/")->mime), HasSubstr("text/html"));
  EXPECT_THAT(std::string(FindAsset("/dashboard.js")->mime), HasSubstr("javascript"));
}

TEST(Dashboard, ThePageIsSelfContainedAndRunsNoInlineScript) {
  const std::string html(FindAsset("/")->body);
  // Every script and stylesheet comes from the server itself: no CDN, no other host.
  std::smatch m;
  const std::regex ref(R"re((src|href)="([^"]*)")re");
  int refs = 0;
  for (auto it = std::sregex_iterator(html.begin(), html.end(), ref); it != std::sregex_iterator(); ++it, ++refs) {
    const std::string url = (*it)[2];
    EXPECT_TRUE(FindAsset(url).has_value()) << url << " is not served by the dashboard";
  }
  EXPECT_EQ(refs, 3);
  EXPECT_THAT(html, Not(HasSubstr("<script>")));  // the CSP forbids inline scripts
  EXPECT_THAT(std::string(kContentSecurityPolicy), HasSubstr("script-src 'self'"));
  // The page polls the documented endpoint and writes run text only as text.
  const std::string js(FindAsset("/dashboard.js")->body);
  EXPECT_THAT(js, HasSubstr("/api/run?after="));
  EXPECT_THAT(js, Not(HasSubstr("innerHTML")));
}

}  // namespace
}  // namespace meridian::dashboard
