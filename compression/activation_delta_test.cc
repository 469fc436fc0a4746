#include "compression/activation_delta.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

namespace meridian::compression {
namespace {

using ::testing::HasSubstr;

// Activations of `rows` sequences of `elements` each that drift slowly from visit to visit, as a
// fine-tuned model's activations at a cut do between epochs.
class Drift {
 public:
  Drift(int64_t rows, int64_t elements) : x_(static_cast<size_t>(rows * elements)) {
    std::normal_distribution<float> g;
    for (auto& v : x_) v = g(rng_);
  }
  const std::vector<float>& Next(float step = 0.01f) {
    std::normal_distribution<float> g(0, step);
    for (auto& v : x_) v += g(rng_);
    return x_;
  }

 private:
  std::mt19937 rng_{7};
  std::vector<float> x_;
};

ActivationStore::Options Memory(int64_t bytes) {
  ActivationStore::Options o;
  o.memory_bytes = bytes;
  return o;
}

TEST(ActivationDelta, ReconstructionsAreEqualOnBothSidesBitForBit) {
  for (const char* codec : {"int4-delta", "int2-delta", "int8-delta"}) {
    DeltaEncoder enc(*CodecSpec::Parse(codec), Memory(1 << 20));
    DeltaDecoder dec(Memory(1 << 20));
    Drift drift(3, 512);
    const std::vector<int64_t> ids = {11, 4, 97};
    std::vector<float> out(3 * 512);
    double first_error = 0, last_error = 0;
    for (int visit = 0; visit < 12; ++visit) {
      const auto& x = drift.Next();
      auto frame = enc.Encode({core::DType::kFloat32, {3, 512}, x.data()}, ids);
      ASSERT_TRUE(frame.ok()) << frame.status();
      EXPECT_LE(static_cast<int64_t>(frame->size()), MaxEncodedBytes(3 * 512));  // what receivers accept
      ASSERT_TRUE(dec.DecodeInto(frame->data(), frame->size(), ids, {3, 512}, out.data()).ok());
      for (int r = 0; r < 3; ++r) {
        std::vector<float> sender;
        ASSERT_TRUE(enc.Reconstruction(ids[r], &sender).ok());
        ASSERT_EQ(0, std::memcmp(sender.data(), out.data() + r * 512, 512 * sizeof(float)))
            << codec << " visit " << visit;
      }
      double err = 0, norm = 0;
      for (size_t i = 0; i < x.size(); ++i) err += (out[i] - x[i]) * (out[i] - x[i]), norm += x[i] * x[i];
      (visit == 0 ? first_error : last_error) = std::sqrt(err / norm);
    }
    EXPECT_EQ(enc.stats().fresh_rows, 3);
    EXPECT_EQ(enc.stats().delta_rows, 33);
    // The deltas track the drift: the error stays at the scale of one step's change, far below direct
    // quantisation's of the same width.
    EXPECT_LT(last_error, 0.02) << codec;
  }
}

TEST(ActivationDelta, Int2DeltasAreOverEightTimesSmallerThanFloat32) {
  DeltaEncoder enc(*CodecSpec::Parse("int2-delta"), Memory(1 << 20));
  Drift drift(4, 4096);
  const std::vector<int64_t> ids = {1, 2, 3, 4};
  (void)enc.Encode({core::DType::kFloat32, {4, 4096}, drift.Next().data()}, ids);
  auto frame = enc.Encode({core::DType::kFloat32, {4, 4096}, drift.Next().data()}, ids);
  ASSERT_TRUE(frame.ok());
  EXPECT_LT(frame->size() * 8.0, 4 * 4096 * 4.0);
}

TEST(ActivationDelta, AMissingBaseIsDetectedNamingTheSequence) {
  DeltaEncoder enc(*CodecSpec::Parse("int4-delta"), Memory(1 << 20));
  Drift drift(2, 64);
  const std::vector<int64_t> ids = {5, 6};
  auto first = enc.Encode({core::DType::kFloat32, {2, 64}, drift.Next().data()}, ids);
  auto second = enc.Encode({core::DType::kFloat32, {2, 64}, drift.Next().data()}, ids);
  ASSERT_TRUE(first.ok() && second.ok());
  std::vector<float> out(128);
  DeltaDecoder missed(Memory(1 << 20));  // never saw the first message
  absl::Status s = missed.DecodeInto(second->data(), second->size(), ids, {2, 64}, out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr("sequence 5"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("holds none"));
  DeltaDecoder twice(Memory(1 << 20));  // saw the first message twice: its version is ahead
  ASSERT_TRUE(twice.DecodeInto(first->data(), first->size(), ids, {2, 64}, out.data()).ok());
  ASSERT_TRUE(twice.DecodeInto(second->data(), second->size(), ids, {2, 64}, out.data()).ok());
  s = twice.DecodeInto(second->data(), second->size(), ids, {2, 64}, out.data());
  EXPECT_THAT(std::string(s.message()), HasSubstr("against version 1"));
  // The receiver expects other sequences than the message carries.
  DeltaDecoder other(Memory(1 << 20));
  s = other.DecodeInto(first->data(), first->size(), {5, 7}, {2, 64}, out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("sequence 6 where sequence 7 was expected"));
  // A plain frame is not a delta message.
  std::vector<float> plain(128, 1.0f);
  auto frame = Encode({core::DType::kFloat32, {2, 64}, plain.data()}, *CodecSpec::Parse("int8"));
  EXPECT_FALSE(other.DecodeInto(frame->data(), frame->size(), ids, {2, 64}, out.data()).ok());
  // A delta codec cannot be used without its encoder.
  EXPECT_FALSE(Encode({core::DType::kFloat32, {2, 64}, plain.data()}, *CodecSpec::Parse("int4-delta")).ok());
}

// A hostile peer's message cannot make the decoder allocate beyond what the expected rows need, nor
// crash it: forged row sizes that overflow, empty messages, zstd-inflated frames are refused.
TEST(ActivationDelta, ForgedMessagesAreRefusedBeforeAnyAllocation) {
  std::vector<float> out(128);
  auto forged = [](uint32_t rows, uint64_t row_elements, bool zstd) {
    std::vector<uint8_t> msg = {'M', 'R', 'A', 'D', 1, 0, 0, 0};
    msg.resize(8 + 12);
    std::memcpy(msg.data() + 8, &rows, 4);
    std::memcpy(msg.data() + 12, &row_elements, 8);
    msg.resize(msg.size() + (zstd ? (64 << 20) : 0));  // zeros: zstd squeezes 64 MiB into a few KB
    CodecSpec spec;
    spec.zstd = zstd;
    return *Encode({core::DType::kUInt8, {static_cast<int64_t>(msg.size())}, msg.data()}, spec);
  };
  DeltaDecoder dec(Memory(1 << 20));
  for (const auto& f :
       {forged(2, (uint64_t{1} << 63) + 64, false), forged(0, 1ull << 40, false), forged(2, 64, true)}) {
    absl::Status s = dec.DecodeInto(f.data(), f.size(), {1, 2}, {2, 64}, out.data());
    EXPECT_FALSE(s.ok());
  }
  EXPECT_EQ(dec.store(), nullptr);  // nothing was stored, or sized, for them
  std::vector<float> none;
  EXPECT_FALSE(dec.DecodeInto(forged(0, 64, false).data(), 28, {}, {0, 64}, none.data()).ok());
}

TEST(ActivationDelta, RowsBeyondMemorySpillToAFileAndComeBack) {
  const auto dir = std::filesystem::temp_directory_path() / ("meridian_delta_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  ActivationStore::Options o = Memory(2 * 256 * 4);  // two rows in memory
  o.spill_bytes = int64_t{1} << 20;
  o.spill_path = (dir / "send.spill").string();
  ActivationStore::Options r = o;
  r.spill_path = (dir / "recv.spill").string();
  {
    DeltaEncoder enc(*CodecSpec::Parse("int2-delta"), o);
    DeltaDecoder dec(r);
    Drift drift(6, 256);
    const std::vector<int64_t> ids = {0, 1, 2, 3, 4, 5};
    std::vector<float> out(6 * 256);
    for (int visit = 0; visit < 4; ++visit) {
      auto frame = enc.Encode({core::DType::kFloat32, {6, 256}, drift.Next().data()}, ids);
      ASSERT_TRUE(frame.ok()) << frame.status();
      ASSERT_TRUE(dec.DecodeInto(frame->data(), frame->size(), ids, {6, 256}, out.data()).ok());
      for (int64_t id : ids) {
        std::vector<float> sender;
        ASSERT_TRUE(enc.Reconstruction(id, &sender).ok());
        ASSERT_EQ(0, std::memcmp(sender.data(), out.data() + id * 256, 256 * sizeof(float)));
      }
    }
    EXPECT_EQ(enc.store()->memory_rows(), 2);
    EXPECT_EQ(enc.store()->spilled_rows(), 4);
    EXPECT_EQ(dec.store()->spilled_rows(), 4);
    EXPECT_EQ(enc.stats().delta_rows, 18);
    EXPECT_TRUE(std::filesystem::exists(o.spill_path));
  }
  EXPECT_FALSE(std::filesystem::exists(o.spill_path));  // removed with the store
  std::filesystem::remove_all(dir);
}

TEST(ActivationDelta, TheMemoryBoundIsHonouredAndBeyondItRowsGoDirect) {
  DeltaEncoder enc(*CodecSpec::Parse("int4-delta"), Memory(3 * 128 * 4));  // three rows, no spill file
  DeltaDecoder dec(Memory(3 * 128 * 4));
  Drift drift(5, 128);
  const std::vector<int64_t> ids = {10, 20, 30, 40, 50};
  std::vector<float> out(5 * 128);
  for (int visit = 0; visit < 3; ++visit) {
    auto frame = enc.Encode({core::DType::kFloat32, {5, 128}, drift.Next().data()}, ids);
    ASSERT_TRUE(frame.ok());
    ASSERT_TRUE(dec.DecodeInto(frame->data(), frame->size(), ids, {5, 128}, out.data()).ok());
  }
  EXPECT_EQ(enc.store()->memory_rows(), 3);
  EXPECT_LE(enc.store()->memory_rows() * 128 * 4, 3 * 128 * 4);
  EXPECT_TRUE(enc.fell_back());
  EXPECT_EQ(enc.stats().direct_rows, 6);  // sequences 40 and 50, every visit
  EXPECT_EQ(enc.stats().delta_rows, 6);
  std::vector<float> unused;
  EXPECT_FALSE(enc.Reconstruction(50, &unused).ok());
}

// int2's encoder picks each block's scale for the least squared error: on bell-shaped data its error is
// well below that of levels spread to the block's absmax (scale absmax / 3, the first candidate, whose
// every error is within a third of the absmax), and no element is off by more than its block's absmax.
TEST(Codec, Int2RoundTripsWithTheLeastSquaredErrorOfItsScales) {
  std::vector<float> x(1001);
  std::mt19937 rng(3);
  std::normal_distribution<float> g;
  for (auto& v : x) v = g(rng);
  auto spec = *CodecSpec::Parse("int2:block=64");
  EXPECT_EQ(spec.ToString(), "int2:block=64");
  auto frame = Encode({core::DType::kFloat32, {1001}, x.data()}, spec);
  ASSERT_TRUE(frame.ok());
  std::vector<float> y(1001);
  ASSERT_TRUE(DecodeInto(frame->data(), frame->size(), core::DType::kFloat32, {1001}, y.data()).ok());
  double chosen = 0, spread = 0;  // squared errors: the encoder's, and at absmax / 3 in every block
  for (size_t b = 0; b < x.size(); b += 64) {
    float amax = 0;
    for (size_t i = b; i < std::min(x.size(), b + 64); ++i) amax = std::max(amax, std::fabs(x[i]));
    for (size_t i = b; i < std::min(x.size(), b + 64); ++i) {
      EXPECT_LE(std::fabs(y[i] - x[i]), amax + 1e-6f);
      chosen += (y[i] - x[i]) * (y[i] - x[i]);
      const float s = amax / 3;
      const int c = std::clamp(static_cast<int>(std::nearbyint((x[i] / s + 3) / 2)), 0, 3);
      spread += (x[i] - (2 * c - 3) * s) * (x[i] - (2 * c - 3) * s);
    }
  }
  EXPECT_LT(chosen, 0.7 * spread);
  // Bits past the last element must be zero.
  (*frame)[frame->size() - 1] |= 0xC0;
  EXPECT_FALSE(Decode(frame->data(), frame->size()).ok());
  EXPECT_NEAR(CompressionRatio(spec, core::DType::kFloat32, 1 << 20), 20.0 / 256, 1e-3);
  EXPECT_EQ(CodecSpec::Parse("int4-delta")->ToString(), "int4-delta:block=64");
  EXPECT_FALSE(CodecSpec::Parse("bf16-delta").ok());
}

}  // namespace
}  // namespace meridian::compression
