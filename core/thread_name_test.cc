#include "core/thread_name.h"

#include <gtest/gtest.h>

#include <memory>
#include <thread>

namespace meridian::core {
namespace {

TEST(ThreadNameTest, ANamedThreadReadsItsNameBackAndOthersKeepTheirs) {
  const std::string before = ThisThreadName();
  std::string seen, long_seen;
  std::thread t([&] {
    NameThisThread("mrd-send");
    seen = ThisThreadName();
    NameThisThread("mrd-a-name-longer-than-fifteen");
    long_seen = ThisThreadName();
  });
  t.join();
  EXPECT_EQ(seen, "mrd-send");
  EXPECT_EQ(long_seen, "mrd-a-name-long");  // cut to the kernel's 15 characters, not refused
  EXPECT_EQ(ThisThreadName(), before);      // only the calling thread is named
}

TEST(ThreadNameTest, NamedThreadIsNamedBeforeItsBodyRuns) {
  std::string seen;
  int moved_in = 0;
  auto value = std::make_unique<int>(7);  // a move-only capture: the body is moved into the thread
  std::thread t = NamedThread("mrd-report", [&seen, &moved_in, v = std::move(value)] {
    seen = ThisThreadName();
    moved_in = *v;
  });
  t.join();
  EXPECT_EQ(seen, "mrd-report");
  EXPECT_EQ(moved_in, 7);
}

}  // namespace
}  // namespace meridian::core
