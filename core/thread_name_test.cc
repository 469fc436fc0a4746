#include "core/thread_name.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace meridian::core
