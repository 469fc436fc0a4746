// The cuBLAS probe: on a GPU it must compute a correct product and plausible throughputs; without one
// (or without CUDA in the build) it must say so, naming the device, rather than report numbers.
#include "gpu/probe.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace meridian::gpu {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

TEST(GpuProbe, WithoutADeviceTheErrorNamesIt) {
  if (Available()) GTEST_SKIP() << "a CUDA device is present: covered by the tests below";
  auto m = MeasureCublasGemm(0, 256, 2);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("cuda:0"));
  EXPECT_THAT(std::string(m.status().message()), AnyOf(HasSubstr("no CUDA device"), HasSubstr("has no CUDA")));
  EXPECT_FALSE(CheckCublasGemm(0).ok());
}

TEST(GpuProbe, CublasComputesACorrectProductAndPlausibleThroughput) {
  if (!Available()) GTEST_SKIP() << "no CUDA device";
  EXPECT_TRUE(CheckCublasGemm(0, 96).ok());
  EXPECT_TRUE(CheckCublasGemm(0, 257).ok());  // not a multiple of any tile
  auto m = MeasureCublasGemm(0, 4096, 5);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE(m->device_name.empty());
  EXPECT_GT(m->fp32_flops_per_second, 1e12);  // any datacenter GPU of the last decade
  EXPECT_LT(m->fp32_flops_per_second, 1e16);
  if (m->bf16_flops_per_second > 0) {  // measured from compute capability 8.0 on: tensor cores
    EXPECT_GT(m->bf16_flops_per_second, m->fp32_flops_per_second);
  }
  EXPECT_GT(m->total_memory_bytes, 1e9);
  EXPECT_LE(m->free_memory_bytes, m->total_memory_bytes);
}

TEST(GpuProbe, AMissingDeviceIsNamed) {
  if (!Available()) GTEST_SKIP() << "no CUDA device";
  auto m = MeasureCublasGemm(999, 256, 1);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("cuda:999 does not exist"));
}

}  // namespace
}  // namespace meridian::gpu
