#include "core/tensor_view.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace meridian::core {
namespace {

TEST(Half, RoundTripsEveryHalfValueExactly) {
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(FloatToHalf(f), h) << h;
  }
}

TEST(Half, RoundsToNearestEven) {
  // The half ulp at 1.0 is 1/1024: exact halfway points round to the even neighbour.
  EXPECT_EQ(HalfToFloat(FloatToHalf(1.0f + 1.0f / 2048)), 1.0f);
  EXPECT_EQ(HalfToFloat(FloatToHalf(1.0f + 3.0f / 2048)), 1.0f + 2.0f / 1024);
  EXPECT_EQ(HalfToFloat(FloatToHalf(1.0f + 0.75f / 1024)), 1.0f + 1.0f / 1024);
  EXPECT_TRUE(std::isinf(HalfToFloat(FloatToHalf(1e6f))));
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(HalfToFloat(FloatToHalf(1e-9f)), 0.0f);
}

TEST(BFloat16, RoundTrip) {
  for (float f : {0.0f, 1.0f, -2.5f, 3.140625f, 65536.0f, -0.0078125f})
    EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(f)), f);
  EXPECT_NEAR(BFloat16ToFloat(FloatToBFloat16(3.14159f)), 3.14159f, 0.01f);
}

TEST(TensorView, SizeAndNames) {
  float data[6] = {};
  TensorView v{DType::kFloat32, {2, 3}, data};
  EXPECT_EQ(v.numel(), 6);
  EXPECT_EQ(v.nbytes(), 24u);
  EXPECT_STREQ(DTypeName(DType::kBFloat16), "bfloat16");
  EXPECT_EQ(DTypeSize(static_cast<DType>(99)), 0u);
}

}  // namespace
}  // namespace meridian::core
