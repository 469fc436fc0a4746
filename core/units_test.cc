#include "core/units.h"

#include <gtest/gtest.h>

namespace meridian::core {
namespace {

TEST(Units, Bandwidth) {
  EXPECT_DOUBLE_EQ(*ParseBandwidth("100Mbit"), 12.5e6);
  EXPECT_DOUBLE_EQ(*ParseBandwidth("1.5 Gbps"), 1.5e9 / 8);
  EXPECT_DOUBLE_EQ(*ParseBandwidth("20Mbit/s"), 2.5e6);
  EXPECT_DOUBLE_EQ(*ParseBandwidth("10MB/s"), 10e6);
  EXPECT_DOUBLE_EQ(*ParseBandwidth("1GiB/s"), 1073741824.0);
  EXPECT_DOUBLE_EQ(*ParseBandwidth("400kbit"), 50e3);
  EXPECT_FALSE(ParseBandwidth("100").ok());
  EXPECT_FALSE(ParseBandwidth("Mbit").ok());
  EXPECT_FALSE(ParseBandwidth("-1Mbit").ok());
  EXPECT_FALSE(ParseBandwidth("1e999Gbit").ok());
  EXPECT_FALSE(ParseBandwidth("12 furlongs").ok());
}

TEST(Units, Duration) {
  EXPECT_DOUBLE_EQ(*ParseDuration("40ms"), 0.04);
  EXPECT_DOUBLE_EQ(*ParseDuration("2s"), 2.0);
  EXPECT_DOUBLE_EQ(*ParseDuration("250us"), 250e-6);
  EXPECT_DOUBLE_EQ(*ParseDuration("1.5min"), 90.0);
  EXPECT_DOUBLE_EQ(*ParseDuration("1e-3s"), 1e-3);
  EXPECT_FALSE(ParseDuration("40").ok());
  EXPECT_FALSE(ParseDuration("forty ms").ok());
}

TEST(Units, Bytes) {
  EXPECT_DOUBLE_EQ(*ParseBytes("16GiB"), 16.0 * 1073741824.0);
  EXPECT_DOUBLE_EQ(*ParseBytes("80GB"), 80e9);
  EXPECT_DOUBLE_EQ(*ParseBytes("4096"), 4096);
  EXPECT_FALSE(ParseBytes("16Gb").ok());
  EXPECT_FALSE(ParseBytes("").ok());
}

TEST(Units, Format) {
  EXPECT_EQ(FormatBandwidth(12.5e6), "100.0 Mbit/s");
  EXPECT_EQ(FormatDuration(0.04), "40.00 ms");
  EXPECT_EQ(FormatBytes(1.5 * 1073741824.0), "1.50 GiB");
}

}  // namespace
}  // namespace meridian::core
