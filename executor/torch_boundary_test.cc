// The torch boundary: exceptions thrown inside libtorch come out of the executor's entries as Status.
#include "executor/torch_boundary.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <stdexcept>

#include "absl/status/statusor.h"

namespace meridian::executor {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// A module whose forward pass fails inside libtorch, as a device error or a shape bug would.
struct ThrowingModule : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) { return torch::matmul(x, torch::ones({3, 3})); }  // x is [2, 2]
};

// A module whose forward pass asks for more memory than any machine has.
struct HungryModule : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) { return x + torch::zeros({int64_t{1} << 23, int64_t{1} << 23}); }
};

TEST(TorchBoundary, ATorchErrorBecomesAnInternalStatusNamingWhere) {
  ThrowingModule m;
  absl::StatusOr<torch::Tensor> r = GuardTorch("stage 1 (site 'b'): step 3", [&]() -> absl::StatusOr<torch::Tensor> {
    return m.forward(torch::ones({2, 2}));
  });
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("stage 1 (site 'b'): step 3: libtorch: "));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("cannot be multiplied"));
  EXPECT_THAT(std::string(r.status().message()), Not(HasSubstr("frame #")));  // no backtrace
}

TEST(TorchBoundary, OutOfMemoryBecomesResourceExhausted) {
  HungryModule m;
  absl::Status s = GuardTorch("building ops 0-3 of the model", [&]() -> absl::Status {
    m.forward(torch::ones({1}));
    return absl::OkStatus();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("building ops 0-3 of the model: out of memory"));

  s = GuardTorch("x", []() -> absl::Status { throw std::bad_alloc(); });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
}

TEST(TorchBoundary, OtherExceptionsAndResultsPassAsTheyShould) {
  absl::Status s = GuardTorch("x", []() -> absl::Status { throw std::runtime_error("bad"); });
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(s.message(), "x: bad");
  s = GuardTorch("x", []() -> absl::Status { throw 42; });
  EXPECT_THAT(std::string(s.message()), HasSubstr("unknown type"));
  // Without an exception the body's own result comes back untouched.
  absl::StatusOr<int> v = GuardTorch("x", []() -> absl::StatusOr<int> { return 7; });
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, 7);
  s = GuardTorch("x", []() -> absl::Status { return absl::NotFoundError("nope"); });
  EXPECT_EQ(s, absl::NotFoundError("nope"));
}

}  // namespace
}  // namespace meridian::executor
