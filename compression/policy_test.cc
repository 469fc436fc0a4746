#include "compression/policy.h"

#include <gtest/gtest.h>

namespace meridian::compression {
namespace {

TEST(Policy, CompressesOnlyWhatTheLinkCannotHide) {
  const int64_t n = 2 * 256 * 512;  // a 2 x 256 x 512 float32 activation: 1 MiB
  // 10 Gbit/s: identity hides behind 10 ms of compute.
  auto fast = ChooseCodec({1.25e9, 1e-4}, core::DType::kFloat32, n, 0.010, ActivationMenu());
  EXPECT_EQ(fast.spec.kind, CodecKind::kIdentity);
  EXPECT_TRUE(fast.hidden);
  // 100 Mbit/s: 84 ms raw, 42 ms bf16, 22 ms int8 -> int8 is the least lossy that hides in 30 ms.
  auto mid = ChooseCodec({12.5e6, 1e-3}, core::DType::kFloat32, n, 0.030, ActivationMenu());
  EXPECT_EQ(mid.spec.kind, CodecKind::kInt8);
  EXPECT_TRUE(mid.hidden);
  EXPECT_NEAR(mid.ratio, CompressionRatio(mid.spec, core::DType::kFloat32, n), 1e-12);
  // 1 Mbit/s: nothing hides; the strongest codec is chosen and flagged.
  auto slow = ChooseCodec({125e3, 1e-2}, core::DType::kFloat32, n, 0.030, ActivationMenu());
  EXPECT_EQ(slow.spec.kind, CodecKind::kInt4);
  EXPECT_FALSE(slow.hidden);
  auto grad = ChooseCodec({125e3, 1e-2}, core::DType::kFloat32, n, 0.5, GradientMenu());
  EXPECT_EQ(grad.spec.kind, CodecKind::kTopK);
}

TEST(Policy, RatiosMatchTheFrameLayout) {
  EXPECT_NEAR(CompressionRatio(*CodecSpec::Parse("int8"), core::DType::kFloat32, 1 << 20), 68.0 / 256, 1e-3);
  EXPECT_NEAR(CompressionRatio(*CodecSpec::Parse("int4"), core::DType::kFloat32, 1 << 20), 36.0 / 256, 1e-3);
  EXPECT_NEAR(CompressionRatio(*CodecSpec::Parse("bf16"), core::DType::kFloat32, 1 << 20), 0.5, 1e-3);
  EXPECT_NEAR(CompressionRatio(*CodecSpec::Parse("topk:k=0.01"), core::DType::kFloat32, 1 << 20), 0.0125, 0.003);
}

}  // namespace
}  // namespace meridian::compression
