// The committed .clang-format is applied: every tracked C++ and CUDA source is as clang-format writes it.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "process.h"

namespace {

using namespace std::chrono_literals;

TEST(FormatCheck, EverySourceFollowsTheCommittedClangFormat) {
  meridian::testing::Process check(std::string("cd ") + MERIDIAN_TEST_SOURCE_DIR +
                                   " && scripts/format.sh --check 2>&1");
  const std::string out = check.ReadAll(120s);
  EXPECT_EQ(check.Wait(10s), 0) << out;
  EXPECT_THAT(out, ::testing::HasSubstr("files follow .clang-format")) << out;
}

}  // namespace
