// Checks the CUDA kernels against the CPU codecs, bit for bit where the arithmetic is the same.
// Every test skips cleanly when no CUDA device is present (CI, this project's build machines).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "compression/codec.h"
#include "compression/cuda/kernels.h"

namespace meridian::compression {
namespace {

#define SKIP_WITHOUT_GPU() \
  if (!cuda::DeviceAvailable()) GTEST_SKIP() << "no CUDA device: GPU kernels not exercised"

std::vector<float> Gaussian(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0, 1);
  std::vector<float> v(n);
  for (auto& x : v) x = g(rng);
  return v;
}

template <typename T>
T* Upload(const std::vector<T>& h) {
  T* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, h.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}

// The CPU frame's payload (after the 56 + 8 byte header of a 1-d tensor).
std::vector<uint8_t> CpuPayload(const std::vector<float>& x, const char* spec) {
  auto f = *Encode({core::DType::kFloat32, {static_cast<int64_t>(x.size())}, x.data()}, *CodecSpec::Parse(spec));
  return std::vector<uint8_t>(f.begin() + 64, f.end());
}

void CheckQuantizer(bool int4, int block) {
  const size_t n = 1000003;
  auto x = Gaussian(n, 3);
  std::string spec = std::string(int4 ? "int4" : "int8") + ":block=" + std::to_string(block);
  auto want = CpuPayload(x, spec.c_str());
  float* dx = Upload(x);
  uint8_t* dp = nullptr;
  int* bad = nullptr;
  ASSERT_EQ(cudaMalloc(&dp, want.size()), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&bad, sizeof(int)), cudaSuccess);
  cudaMemset(bad, 0, sizeof(int));
  int err =
      int4 ? cuda::QuantizeInt4(dx, n, block, dp, bad, nullptr) : cuda::QuantizeInt8(dx, n, block, dp, bad, nullptr);
  ASSERT_EQ(err, 0) << cuda::ErrorName(err);
  std::vector<uint8_t> got(want.size());
  ASSERT_EQ(cudaMemcpy(got.data(), dp, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got, want) << spec;
  // Dequantise on the GPU and compare with the CPU decoder's floats.
  float* dout = nullptr;
  ASSERT_EQ(cudaMalloc(&dout, n * sizeof(float)), cudaSuccess);
  err = int4 ? cuda::DequantizeInt4(dp, n, block, dout, nullptr) : cuda::DequantizeInt8(dp, n, block, dout, nullptr);
  ASSERT_EQ(err, 0) << cuda::ErrorName(err);
  std::vector<float> back(n);
  cudaMemcpy(back.data(), dout, n * sizeof(float), cudaMemcpyDeviceToHost);
  auto f = *Encode({core::DType::kFloat32, {static_cast<int64_t>(n)}, x.data()}, *CodecSpec::Parse(spec));
  auto cpu = *Decode(f.data(), f.size());
  EXPECT_EQ(0, std::memcmp(back.data(), cpu.data<float>(), n * sizeof(float)));
  int flag = 0;
  cudaMemcpy(&flag, bad, sizeof(int), cudaMemcpyDeviceToHost);
  EXPECT_EQ(flag, 0);
  cudaFree(dx), cudaFree(dp), cudaFree(bad), cudaFree(dout);
}

TEST(GpuKernels, Int8MatchesCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  CheckQuantizer(false, 64);
  CheckQuantizer(false, 256);
}

TEST(GpuKernels, Int4MatchesCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  CheckQuantizer(true, 64);
  CheckQuantizer(true, 32);
}

TEST(GpuKernels, NonFiniteInputIsFlagged) {
  SKIP_WITHOUT_GPU();
  std::vector<float> x(1000, 1.0f);
  x[517] = NAN;
  float* dx = Upload(x);
  uint8_t* dp = nullptr;
  int* bad = nullptr;
  cudaMalloc(&dp, 4 * 16 + 1000);
  cudaMalloc(&bad, sizeof(int));
  cudaMemset(bad, 0, sizeof(int));
  ASSERT_EQ(cuda::QuantizeInt8(dx, 1000, 64, dp, bad, nullptr), 0);
  int flag = 0;
  cudaMemcpy(&flag, bad, sizeof(int), cudaMemcpyDeviceToHost);
  EXPECT_EQ(flag, 1);
  cudaFree(dx), cudaFree(dp), cudaFree(bad);
}

TEST(GpuKernels, ThresholdTopKSelectsExactlyTheElementsAboveIt) {
  SKIP_WITHOUT_GPU();
  const size_t n = 1 << 22;
  auto x = Gaussian(n, 9);
  float* dx = Upload(x);
  float t = 0;
  ASSERT_EQ(cuda::EstimateThreshold(dx, n, 0.01, &t, nullptr), 0);
  uint32_t* di = nullptr;
  float* dv = nullptr;
  cudaMalloc(&di, n * 4);
  cudaMalloc(&dv, n * 4);
  int64_t count = 0;
  int err = cuda::SelectAboveThreshold(dx, n, t, di, dv, &count, nullptr);
  ASSERT_EQ(err, 0) << cuda::ErrorName(err);
  std::vector<uint32_t> want;
  for (size_t i = 0; i < n; ++i)
    if (std::fabs(x[i]) >= t) want.push_back(static_cast<uint32_t>(i));
  ASSERT_EQ(count, static_cast<int64_t>(want.size()));
  EXPECT_NEAR(static_cast<double>(count) / n, 0.01, 0.002);  // the sampled threshold keeps about 1%
  std::vector<uint32_t> idx(count);
  std::vector<float> val(count);
  cudaMemcpy(idx.data(), di, count * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(val.data(), dv, count * 4, cudaMemcpyDeviceToHost);
  EXPECT_EQ(idx, want);
  for (int64_t i = 0; i < count; ++i) ASSERT_EQ(val[i], x[idx[i]]);
  cudaFree(dx), cudaFree(di), cudaFree(dv);
}

}  // namespace
}  // namespace meridian::compression
