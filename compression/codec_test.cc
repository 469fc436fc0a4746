#include "compression/codec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "compression/internal/crc32c.h"

// The checksum exactly as the encoder computes it: CRC32C over the header (minus its own field) and
// the payload. Lets tests forge frames that pass the checksum and must be caught by validation.
static uint32_t TestChecksum(const uint8_t* f, size_t size) {
  using meridian::compression::internal::Crc32c;
  size_t header = 56 + 8 * f[8];
  if (header > size) header = size;
  uint32_t crc = Crc32c(0, f, 48);
  crc = Crc32c(crc, f + 52, header - 52);
  return meridian::compression::internal::Crc32cStriped(crc, f + header, size - header);
}

namespace meridian::compression {
namespace {

using core::DType;
using ::testing::HasSubstr;

std::vector<float> Gaussian(size_t n, unsigned seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

double RelL2(const std::vector<float>& a, const float* b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) num += (a[i] - b[i]) * (a[i] - b[i]), den += a[i] * a[i];
  return std::sqrt(num / den);
}

core::TensorView View(const std::vector<float>& v, std::vector<int64_t> shape) {
  return {DType::kFloat32, std::move(shape), v.data()};
}

struct CodecCase {
  const char* spec;
  double max_rel_l2;  // bound on relative L2 error on Gaussian data (top-k: on its kept part, see below)
};

class RoundTrip : public ::testing::TestWithParam<CodecCase> {};

TEST_P(RoundTrip, PreservesShapeDtypeAndBoundsTheError) {
  auto spec = CodecSpec::Parse(GetParam().spec);
  ASSERT_TRUE(spec.ok()) << spec.status();
  for (std::vector<int64_t> shape : std::vector<std::vector<int64_t>>{{4, 1000}, {7, 3, 5}, {1}, {0, 5}, {65537}}) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    auto x = Gaussian(static_cast<size_t>(n), 42);
    auto frame = Encode(View(x, shape), *spec);
    ASSERT_TRUE(frame.ok()) << frame.status();
    auto t = Decode(frame->data(), frame->size());
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->dtype, DType::kFloat32);
    EXPECT_EQ(t->shape, shape);
    ASSERT_EQ(t->numel(), n);
    if (n >= 1000 && spec->kind != CodecKind::kTopK) {
      EXPECT_LE(RelL2(x, t->data<float>()), GetParam().max_rel_l2);
    }
    auto info = InspectFrame(frame->data(), frame->size());
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->spec.kind, spec->kind);
    if (n >= 1000 && !spec->zstd) {
      double predicted = CompressionRatio(*spec, DType::kFloat32, n) * n * 4 + 8.0 * (shape.size() - 1);
      if (spec->kind == CodecKind::kTopK) {
        EXPECT_LE(frame->size(), predicted * 1.1);
      } else {
        EXPECT_EQ(frame->size(), static_cast<size_t>(predicted + 0.5));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Codecs, RoundTrip,
                         ::testing::Values(CodecCase{"identity", 0.0}, CodecCase{"identity+zstd", 0.0},
                                           CodecCase{"fp16", 1e-3}, CodecCase{"bf16", 5e-3}, CodecCase{"int8", 0.01},
                                           CodecCase{"int8:block=256", 0.012}, CodecCase{"int8+zstd", 0.01},
                                           CodecCase{"int4", 0.16}, CodecCase{"int4:block=32", 0.14},
                                           CodecCase{"topk:k=0.01", 1.0}, CodecCase{"topk-int8:k=0.05", 1.0},
                                           CodecCase{"topk:k=0.5+zstd", 1.0}),
                         [](const auto& info) {
                           std::string s = info.param.spec;
                           for (char& c : s)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return s;
                         });

TEST(Codec, Int8ErrorBoundOnGaussianIsOnePercent) {
  auto x = Gaussian(1 << 20, 7);
  auto f = Encode(View(x, {1 << 20}), *CodecSpec::Parse("int8"));
  auto t = Decode(f->data(), f->size());
  EXPECT_LE(RelL2(x, t->data<float>()), 0.01);
  // Per element, the error is at most half a quantisation step of its block.
  const float* y = t->data<float>();
  for (size_t b = 0; b < x.size(); b += 64) {
    float amax = 0;
    for (size_t i = b; i < b + 64; ++i) amax = std::max(amax, std::fabs(x[i]));
    for (size_t i = b; i < b + 64; ++i) ASSERT_LE(std::fabs(x[i] - y[i]), amax / 127 * 0.5f + 1e-6f);
  }
}

TEST(Codec, Fp16AndBf16ExactForRepresentableValues) {
  std::vector<float> v = {0.0f, 1.0f, -2.5f, 65504.0f, 6.103515625e-05f, 0.333251953125f, -1025.0f};
  for (const char* c : {"fp16", "bf16"}) {
    std::vector<float> in = v;
    if (std::string(c) == "bf16") in = {0.0f, 1.0f, -2.5f, 3.140625f, 65536.0f, -0.0078125f, 1.5e38f};
    if (std::string(c) == "bf16") in.back() = core::BFloat16ToFloat(core::FloatToBFloat16(1.5e38f));
    auto f = Encode(View(in, {static_cast<int64_t>(in.size())}), *CodecSpec::Parse(c));
    auto t = Decode(f->data(), f->size());
    ASSERT_TRUE(t.ok());
    EXPECT_EQ(0, std::memcmp(t->data<float>(), in.data(), 4 * in.size())) << c;
  }
}

TEST(Codec, Fp16SaturatesInsteadOfOverflowing) {
  std::vector<float> in = {1e6f, -3e38f, 1.0f, 65519.0f, -70000.0f};
  auto f = Encode(View(in, {5}), *CodecSpec::Parse("fp16"));
  ASSERT_TRUE(f.ok()) << f.status();
  auto t = Decode(f->data(), f->size());
  ASSERT_TRUE(t.ok());
  const float* y = t->data<float>();
  EXPECT_EQ(y[0], 65504.0f);
  EXPECT_EQ(y[1], -65504.0f);
  EXPECT_EQ(y[2], 1.0f);
  EXPECT_EQ(y[3], 65504.0f);
  EXPECT_EQ(y[4], -65504.0f);
  // Non-finite input is refused, not encoded.
  std::vector<float> bad = {1.0f, NAN};
  auto b = Encode(View(bad, {2}), *CodecSpec::Parse("fp16"));
  EXPECT_FALSE(b.ok());
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("non-finite"));
}

// The receivers' bound on a frame's size holds for every codec, even on incompressible data.
TEST(Codec, MaxEncodedBytesBoundsEveryCodec) {
  for (int64_t n : {1, 7, 1000, 65537}) {
    std::vector<float> x(static_cast<size_t>(n));
    std::mt19937 rng(static_cast<unsigned>(n));
    std::uniform_real_distribution<float> u(-1e3f, 1e3f);
    for (auto& v : x) v = u(rng);
    for (const char* c : {"identity", "identity+zstd", "fp16", "bf16+zstd", "int8", "int4+zstd", "int2", "topk:k=1",
                          "topk:k=1+zstd", "topk-int8:k=1", "topk:k=0.5"}) {
      auto spec = CodecSpec::Parse(c);
      ASSERT_TRUE(spec.ok()) << c;
      auto f = Encode(View(x, {n}), *spec);
      ASSERT_TRUE(f.ok()) << c << f.status();
      EXPECT_LE(static_cast<int64_t>(f->size()), MaxEncodedBytes(n)) << c << " " << n;
    }
  }
}

TEST(Codec, TopKKeepsExactlyTheLargestAndIsExactThere) {
  auto x = Gaussian(100000, 3);
  auto f = Encode(View(x, {100000}), *CodecSpec::Parse("topk:k=0.01"));
  auto t = Decode(f->data(), f->size());
  ASSERT_TRUE(t.ok());
  const float* y = t->data<float>();
  std::vector<float> mags;
  for (float v : x) mags.push_back(std::fabs(v));
  std::nth_element(mags.begin(), mags.begin() + 999, mags.end(), std::greater<float>());
  float kth = mags[999];
  int kept = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (y[i] != 0) {
      ++kept;
      EXPECT_EQ(y[i], x[i]);
      EXPECT_GE(std::fabs(x[i]), kth);
    } else {
      EXPECT_LE(std::fabs(x[i]), kth);
    }
  }
  EXPECT_EQ(kept, 1000);
  EXPECT_LT(f->size(), 100000 * 4 / 50);  // about 5 bytes per kept element
}

// Chunk-wise top-k (SparseLoCo's): each run of `chunk` elements keeps its own largest fraction, so a chunk
// of small values still sends some; the frame decodes as any top-k frame.
TEST(Codec, ChunkedTopKKeepsEachChunksLargest) {
  auto x = Gaussian(1000, 4);
  for (int i = 0; i < 250; ++i) x[i] *= 100;  // the first quarter dwarfs the rest
  auto spec = CodecSpec::Parse("topk:k=0.04:chunk=250");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->ShortString(), "topk:k=0.04:chunk=250");
  auto f = Encode(View(x, {1000}), *spec);
  ASSERT_TRUE(f.ok());
  auto t = Decode(f->data(), f->size());
  ASSERT_TRUE(t.ok());
  const float* y = t->data<float>();
  for (int c = 0; c < 4; ++c) {  // 10 of each chunk's 250, its largest
    std::vector<float> mags;
    for (int i = 250 * c; i < 250 * (c + 1); ++i) mags.push_back(std::fabs(x[i]));
    std::nth_element(mags.begin(), mags.begin() + 9, mags.end(), std::greater<float>());
    int kept = 0;
    for (int i = 250 * c; i < 250 * (c + 1); ++i)
      if (y[i] != 0) {
        ++kept;
        EXPECT_EQ(y[i], x[i]);
        EXPECT_GE(std::fabs(x[i]), mags[9]);
      }
    EXPECT_EQ(kept, 10) << "chunk " << c;
  }
  // Without chunks the first quarter takes all 40.
  auto whole = Encode(View(x, {1000}), *CodecSpec::Parse("topk:k=0.04"));
  auto w = Decode(whole->data(), whole->size());
  int first = 0;
  for (int i = 0; i < 250; ++i) first += w->data<float>()[i] != 0;
  EXPECT_EQ(first, 40);
  // A last, shorter chunk keeps its own share; the ratio prices the rounding.
  auto odd = Encode(View(x, {999}), *CodecSpec::Parse("topk-int8:k=0.04:chunk=250"));
  ASSERT_TRUE(odd.ok());
  EXPECT_TRUE(Decode(odd->data(), odd->size()).ok());
  EXPECT_THAT(CodecSpec::Parse("int8:chunk=64").status().message(),
              testing::HasSubstr("chunk option is for the top-k"));
  EXPECT_FALSE(CodecSpec::Parse("topk:chunk=0").ok());
  EXPECT_THAT(CodecSpec::Parse("topk:chunks=4").status().message(), testing::HasSubstr("(block, k, chunk, level)"));
}

// Error feedback with a decay (SparseLoCo's accumulator): what is encoded is the input plus beta times
// the residual, and the new residual is that minus what was sent; beta = 1 is plain error feedback.
TEST(ErrorFeedback, DecayScalesTheResidualBeforeItIsAdded) {
  const CodecSpec topk = *CodecSpec::Parse("topk:k=0.25");
  std::vector<float> x = {4, 1, 0.5f, -2}, y = {0, 0, 0, 0};
  for (float beta : {0.5f, 1.0f}) {
    ErrorFeedback ef(topk, beta);
    auto f = ef.Encode(View(x, {4}));  // keeps 4: residual {0, 1, 0.5, -2}
    ASSERT_TRUE(f.ok());
    EXPECT_EQ(ef.residual(), (std::vector<float>{0, 1, 0.5f, -2}));
    f = ef.Encode(View(y, {4}));  // encodes beta x {0, 1, 0.5, -2}: keeps -2 beta
    ASSERT_TRUE(f.ok());
    auto t = Decode(f->data(), f->size());
    ASSERT_TRUE(t.ok());
    EXPECT_EQ(std::vector<float>(t->data<float>(), t->data<float>() + 4), (std::vector<float>{0, 0, 0, -2 * beta}));
    EXPECT_EQ(ef.residual(), (std::vector<float>{0, beta, 0.5f * beta, 0}));
  }
}

TEST(Codec, TopKPicksTheSmallerIndexEncoding) {
  auto x = Gaussian(80000, 5);
  auto sparse = Encode(View(x, {80000}), *CodecSpec::Parse("topk:k=0.001"));
  auto dense = Encode(View(x, {80000}), *CodecSpec::Parse("topk:k=0.5"));
  // 80 indices as varints (< 2 bytes each) vs a 10000-byte bitmap; 40000 varints vs the bitmap.
  EXPECT_LT(sparse->size(), 60 + 80 * 2 + 80 * 4 + 8);
  EXPECT_LE(dense->size(), 80 + 10000 + 40000 * 4 + 8);
  EXPECT_TRUE(Decode(dense->data(), dense->size()).ok());
}

TEST(Codec, Float16AndBFloat16InputsKeepTheirDtype) {
  auto x = Gaussian(4096, 9);
  std::vector<uint16_t> h(x.size());
  core::FromFloat32(DType::kBFloat16, x.data(), h.data(), h.size());
  auto f = Encode({DType::kBFloat16, {64, 64}, h.data()}, *CodecSpec::Parse("int8"));
  ASSERT_TRUE(f.ok());
  auto t = Decode(f->data(), f->size());
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->dtype, DType::kBFloat16);
  EXPECT_EQ(t->bytes.size(), 4096u * 2);
}

TEST(Codec, RejectsBadInputs) {
  std::vector<float> nan = {1.0f, NAN, 2.0f, 3.0f};
  EXPECT_EQ(Encode(View(nan, {4}), *CodecSpec::Parse("int8")).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<int32_t> ints = {1, 2};
  EXPECT_FALSE(Encode({DType::kInt32, {2}, ints.data()}, *CodecSpec::Parse("int8")).ok());
  EXPECT_TRUE(Encode({DType::kInt32, {2}, ints.data()}, *CodecSpec::Parse("identity")).ok());
  EXPECT_FALSE(CodecSpec::Parse("int3").ok());
  EXPECT_FALSE(CodecSpec::Parse("int8:block=3").ok());
  EXPECT_FALSE(CodecSpec::Parse("topk:k=0").ok());
  EXPECT_FALSE(CodecSpec::Parse("topk:q=1").ok());
  EXPECT_EQ(CodecSpec::Parse("topk-int8:k=0.05+zstd")->ToString(), "topk-int8:k=0.05:block=64+zstd");
}

// ---- invalid frames: every mutation is an error, never a crash ----

std::vector<uint8_t> SampleFrame(const char* spec, size_t n = 5000) {
  auto x = Gaussian(n, 11);
  return *Encode(View(x, {static_cast<int64_t>(n)}), *CodecSpec::Parse(spec));
}

void Reseal(std::vector<uint8_t>& f);  // recompute the checksum after a deliberate edit

TEST(Frame, TruncationAtEveryLengthIsAnError) {
  for (const char* spec : {"int8", "topk:k=0.01", "int4+zstd", "identity"}) {
    auto f = SampleFrame(spec, 300);
    for (size_t len = 0; len < f.size(); ++len) {
      auto t = Decode(f.data(), len);
      ASSERT_FALSE(t.ok()) << spec << " len " << len;
    }
    EXPECT_FALSE(Decode(nullptr, 0).ok());
  }
}

TEST(Frame, EveryByteFlipIsDetected) {
  for (const char* spec : {"int8", "topk:k=0.05", "fp16+zstd"}) {
    auto f = SampleFrame(spec, 400);
    for (size_t i = 0; i < f.size(); ++i) {
      auto g = f;
      g[i] ^= 0x5a;
      ASSERT_FALSE(Decode(g.data(), g.size()).ok()) << spec << " byte " << i;
    }
  }
}

TEST(Crc32c, KnownVectorsAndStripedLanesAgreeWithSoftware) {
  using internal::Crc32c;
  const char* check = "123456789";
  EXPECT_EQ(Crc32c(0, reinterpret_cast<const uint8_t*>(check), 9), 0xE3069283u);  // the standard check value
  // The striped form equals CRC-32C of the four lane CRCs computed one word at a time.
  std::vector<uint8_t> data(1003);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 131 + 7);
  uint32_t lanes[4] = {0, 0, 0, 0};
  std::vector<uint8_t> lane_bytes[4];
  for (size_t w = 0; w < data.size() / 8; ++w)
    lane_bytes[w % 4].insert(lane_bytes[w % 4].end(), data.begin() + 8 * w, data.begin() + 8 * w + 8);
  lane_bytes[0].insert(lane_bytes[0].end(), data.end() - data.size() % 8, data.end());
  uint8_t packed[16];
  for (int j = 0; j < 4; ++j) {
    lanes[j] = Crc32c(0, lane_bytes[j].data(), lane_bytes[j].size());
    std::memcpy(packed + 4 * j, &lanes[j], 4);
  }
  EXPECT_EQ(internal::Crc32cStriped(0, data.data(), data.size()), Crc32c(0, packed, 16));
}

TEST(Frame, ChecksumMismatchIsReportedAsSuch) {
  auto f = SampleFrame("int8");
  f.back() ^= 1;
  auto t = Decode(f.data(), f.size());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(t.status().message()), HasSubstr("checksum"));
}

// Semantically invalid frames with a valid checksum: the decoder's own checks must catch them.
TEST(Frame, ResealedCorruptionsAreCaughtByValidation) {
  auto set = [](std::vector<uint8_t> f, size_t off, const void* v, size_t n) {
    std::memcpy(f.data() + off, v, n);
    Reseal(f);
    return f;
  };
  auto base = SampleFrame("int8", 1024);
  // A scale so large that 127 times it is infinite is capped like NaN, infinite and negative ones.
  const float nan = NAN, inf = INFINITY, neg = -1.0f, huge_scale = std::numeric_limits<float>::max() / 2;
  const size_t payload = 56 + 8;
  for (float s : {nan, inf, neg, huge_scale}) {
    auto f = set(base, payload, &s, 4);
    auto t = Decode(f.data(), f.size());
    EXPECT_THAT(std::string(t.status().message()), HasSubstr("scale")) << s;
  }
  const int64_t huge = int64_t{1} << 50;
  auto absurd = set(base, 56, &huge, 8);
  EXPECT_THAT(std::string(Decode(absurd.data(), absurd.size()).status().message()), HasSubstr("absurd dimension"));
  const int64_t wrong = 1023;
  auto count = set(base, 16, &wrong, 8);
  EXPECT_THAT(std::string(Decode(count.data(), count.size()).status().message()),
              HasSubstr("does not match the shape"));
  uint8_t ndim = 9;
  auto dims = set(base, 8, &ndim, 1);
  EXPECT_THAT(std::string(Decode(dims.data(), dims.size()).status().message()), HasSubstr("dimensions"));
  uint8_t version = 2;
  auto ver = set(base, 4, &version, 1);
  EXPECT_THAT(std::string(Decode(ver.data(), ver.size()).status().message()), HasSubstr("version"));

  // Top-k: an index out of range, and indices that would go backwards (a varint gap cannot be negative,
  // so an unsorted list shows up as an overflowing position).
  auto tk = SampleFrame("topk:k=0.01", 10000);  // 100 indices, varint-coded
  size_t idx0 = payload + 8;
  uint8_t big[3] = {0xff, 0xff, 0x7f};  // replaces the first varint(s) with 2097151
  auto out = tk;
  std::memcpy(out.data() + idx0, big, 3);
  Reseal(out);
  auto r = Decode(out.data(), out.size());
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  // Limits: a receiver that expects small tensors refuses a large one before allocating.
  DecodeLimits small;
  small.max_elements = 100;
  EXPECT_FALSE(Decode(base.data(), base.size(), small).ok());
}

void Reseal(std::vector<uint8_t>& f) {
  uint32_t c = TestChecksum(f.data(), f.size());
  std::memcpy(f.data() + 48, &c, 4);
}

}  // namespace
}  // namespace meridian::compression

namespace meridian::compression {
namespace {

// Plans name codecs by their short form; it must read back as the same spec.
TEST(Codec, ShortStringsParseBackToTheSameSpec) {
  for (const char* text : {"identity", "fp16", "bf16", "int8", "int4", "int2", "int8-delta", "int4-delta", "topk",
                           "topk-int8", "topk:k=0.001", "int4:block=32", "int8+zstd", "topk-int8:k=0.1:block=128"}) {
    auto spec = CodecSpec::Parse(text);
    ASSERT_TRUE(spec.ok()) << text;
    auto again = CodecSpec::Parse(spec->ShortString());
    ASSERT_TRUE(again.ok()) << spec->ShortString();
    EXPECT_EQ(again->ToString(), spec->ToString()) << text;
  }
  EXPECT_EQ(CodecSpec::Parse("int8:block=64")->ShortString(), "int8");
  EXPECT_EQ(CodecSpec::Parse("int4-delta")->ShortString(), "int4-delta");
  EXPECT_EQ(CodecSpec::Parse("int4:block=32")->ShortString(), "int4:block=32");
}

// What the planner prices a codec at: the payload per input byte, exactly the frame layout's.
TEST(Codec, PayloadRatiosAreTheFrameLayouts) {
  EXPECT_DOUBLE_EQ(PayloadRatio(*CodecSpec::Parse("identity"), core::DType::kFloat32), 1.0);
  EXPECT_DOUBLE_EQ(PayloadRatio(*CodecSpec::Parse("bf16"), core::DType::kFloat32), 0.5);
  EXPECT_DOUBLE_EQ(PayloadRatio(*CodecSpec::Parse("int8"), core::DType::kFloat32), 68.0 / 256);
  EXPECT_DOUBLE_EQ(PayloadRatio(*CodecSpec::Parse("int4"), core::DType::kFloat32), 36.0 / 256);
  EXPECT_DOUBLE_EQ(PayloadRatio(*CodecSpec::Parse("int2"), core::DType::kFloat32), 20.0 / 256);
  const double ratio = PayloadRatio(*CodecSpec::Parse("int8"), core::DType::kFloat32);
  EXPECT_NEAR(CompressionRatio(*CodecSpec::Parse("int8"), core::DType::kFloat32, 1 << 22), ratio, 1e-4);
}

}  // namespace
}  // namespace meridian::compression
