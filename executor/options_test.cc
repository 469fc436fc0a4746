#include "executor/options.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>

namespace meridian::executor {
namespace {

using ::testing::HasSubstr;

std::string Spec() {
  const char* s = std::getenv("MERIDIAN_SOURCE_DIR");
  return std::string(s ? s : MERIDIAN_TEST_SOURCE_DIR) + "/examples/clusters/local.yaml";
}

auto Env(std::map<std::string, std::string> m) {
  return [m](const char* k) -> std::optional<std::string> {
    auto it = m.find(k);
    return it == m.end() ? std::nullopt : std::optional<std::string>(it->second);
  };
}

TEST(ExecutorOptions, FlagsOverEnvironmentOverSpec) {
  ExecutorFlags f;
  f.spec = Spec();
  f.site = "medium";
  auto o = ResolveOptions(f, Env({}));
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->coordinator, "127.0.0.1:7400");
  EXPECT_EQ(o->listen, "127.0.0.1:7402");
  EXPECT_THAT(o->certs, HasSubstr("runs/local/certs/bundles/medium"));
  EXPECT_EQ(o->device, "cpu");
  auto e = ResolveOptions(f, Env({{"MERIDIAN_COORDINATOR", "10.0.0.1:9000"}, {"MERIDIAN_DEVICE", "cuda:1"}}));
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->coordinator, "10.0.0.1:9000");
  EXPECT_EQ(e->device, "cuda:1");
  f.coordinator = "coord.example.com:1";
  auto g = ResolveOptions(f, Env({{"MERIDIAN_COORDINATOR", "10.0.0.1:9000"}}));
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->coordinator, "coord.example.com:1");
}

TEST(ExecutorOptions, ErrorsNameTheSetting) {
  ExecutorFlags f;
  EXPECT_THAT(std::string(ResolveOptions(f, Env({})).status().message()), HasSubstr("--site"));
  f.site = "x";
  EXPECT_THAT(std::string(ResolveOptions(f, Env({})).status().message()), HasSubstr("--coordinator"));
  f.coordinator = "nope";
  EXPECT_THAT(std::string(ResolveOptions(f, Env({})).status().message()), HasSubstr("coordinator address (from flag)"));
  f.coordinator = "h:1";
  f.certs = "/c";
  f.device = "tpu:0";
  EXPECT_THAT(std::string(ResolveOptions(f, Env({})).status().message()), HasSubstr("'tpu:0' (from flag)"));
  ExecutorFlags s;
  s.spec = Spec();
  s.site = "atlantis";
  EXPECT_THAT(std::string(ResolveOptions(s, Env({})).status().message()),
              HasSubstr("'atlantis' (from flag) is not in the spec"));
  EXPECT_THAT(std::string(ResolveOptions(ExecutorFlags{}, Env({{"MERIDIAN_SITE", "a"}, {"MERIDIAN_COORDINATOR", "h"}}))
                              .status()
                              .message()),
              HasSubstr("from $MERIDIAN_COORDINATOR"));
}

}  // namespace
}  // namespace meridian::executor
