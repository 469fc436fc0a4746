#include "executor/receive_ahead.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>

#include "compression/codec.h"

namespace meridian::executor {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

rpc::TensorKey Key(int mb) { return {"job", 0, mb, 0, v1::FORWARD, 0}; }

// A frame of 4 floats, each `value`.
std::vector<uint8_t> Frame(float value) {
  std::vector<float> v(4, value);
  auto f = compression::Encode({core::DType::kFloat32, {4}, v.data()}, *compression::CodecSpec::Parse("identity"));
  EXPECT_TRUE(f.ok()) << f.status();
  return *f;
}

ReceiveAhead::Decode Decoder() {
  return [](const ExpectedTensor& e, const std::vector<uint8_t>& frame) -> absl::StatusOr<torch::Tensor> {
    auto t = torch::empty(e.shape, torch::kFloat32);
    absl::Status s =
        compression::DecodeInto(frame.data(), frame.size(), core::DType::kFloat32, e.shape, t.data_ptr<float>());
    if (!s.ok()) return s;
    return t;
  };
}

std::vector<ExpectedTensor> Expect(int n) {
  std::vector<ExpectedTensor> e;
  for (int mb = 0; mb < n; ++mb) e.push_back({mb % 2 ? "b" : "a", Key(mb), {4}, {}});
  return e;
}

// Waits (at most 10 s) until `ahead` has decoded `n` tensors.
bool DecodedReaches(const ReceiveAhead& ahead, int n) {
  for (int i = 0; i < 1000 && ahead.decoded() < n; ++i) std::this_thread::sleep_for(10ms);
  return ahead.decoded() >= n;
}

// Frames arriving in any order are decoded before the compute thread asks, at most `lookahead` ahead,
// and handed out in the order the step expects.
TEST(ReceiveAhead, DecodesAheadInTheStepsOrderWithinItsLookahead) {
  rpc::TensorInbox inbox;
  ReceiveAhead ahead(&inbox, Expect(4), Decoder(), /*lookahead=*/2);
  for (int mb : {3, 1, 2, 0}) ASSERT_TRUE(inbox.Deliver(mb % 2 ? "b" : "a", Key(mb), Frame(mb + 0.5f)).ok());
  ASSERT_TRUE(DecodedReaches(ahead, 2));
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(ahead.decoded(), 2) << "more than the lookahead decoded before any was taken";
  EXPECT_EQ(inbox.pending(), 2u);  // the other two frames still wait in the inbox, undecoded
  for (int mb = 0; mb < 4; ++mb) {
    auto t = ahead.Take(mb % 2 ? "b" : "a", Key(mb), 10s);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE(torch::equal(*t, torch::full({4}, mb + 0.5f)));
  }
  EXPECT_EQ(ahead.decoded(), 4);
  EXPECT_EQ(inbox.pending(), 0u);
}

// A frame that does not decode fails the Take that asks for it (and every later one), after the tensors
// decoded before it were handed out; a peer that failed does the same.
TEST(ReceiveAhead, AFrameThatDoesNotDecodeFailsItsTakeAfterTheOnesBefore) {
  rpc::TensorInbox inbox;
  ReceiveAhead ahead(&inbox, Expect(3), Decoder());
  std::vector<uint8_t> bad = Frame(1);
  bad[bad.size() - 1] ^= 0xff;  // the checksum no longer matches
  ASSERT_TRUE(inbox.Deliver("a", Key(0), Frame(0)).ok());
  ASSERT_TRUE(inbox.Deliver("b", Key(1), bad).ok());
  ASSERT_TRUE(inbox.Deliver("a", Key(2), Frame(2)).ok());
  EXPECT_TRUE(ahead.Take("a", Key(0), 10s).ok());
  auto second = ahead.Take("b", Key(1), 10s);
  EXPECT_FALSE(second.ok());
  EXPECT_THAT(second.status().message(), HasSubstr("checksum"));
  EXPECT_FALSE(ahead.Take("a", Key(2), 10s).ok());

  rpc::TensorInbox inbox2;
  ReceiveAhead ahead2(&inbox2, Expect(2), Decoder());
  inbox2.FailPeer("a", "its stream broke");
  auto t = ahead2.Take("a", Key(0), 10s);
  EXPECT_TRUE(absl::IsUnavailable(t.status())) << t.status();
  EXPECT_THAT(t.status().message(), HasSubstr("peer 'a' failed"));
}

// A tensor that does not come in time fails its Take naming the peer and the key, and the receiver still
// stops (its destructor ends the wait for a frame that never comes). Asking out of order is refused.
TEST(ReceiveAhead, ATensorThatDoesNotComeTimesOutAndOrderIsChecked) {
  rpc::TensorInbox inbox;
  {
    ReceiveAhead ahead(&inbox, Expect(2), Decoder());
    auto wrong = ahead.Take("b", Key(1), 10s);
    EXPECT_TRUE(absl::IsInvalidArgument(wrong.status())) << wrong.status();
    auto t = ahead.Take("a", Key(0), 50ms);
    EXPECT_TRUE(absl::IsDeadlineExceeded(t.status())) << t.status();
    EXPECT_THAT(t.status().message(), HasSubstr("from peer 'a'"));
    EXPECT_THAT(t.status().message(), HasSubstr(Key(0).ToString()));
  }
  EXPECT_EQ(inbox.pending(), 0u);
}

}  // namespace
}  // namespace meridian::executor
