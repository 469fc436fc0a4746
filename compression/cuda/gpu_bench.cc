// GPU kernel throughput against a device-to-device copy of the same buffer (the ceiling).
//   build/compression/cuda/gpu_bench        (on a GPU machine; scripts/gpu_check.sh runs it)
#include <cuda_runtime.h>

#include <cstdio>
#include <functional>
#include <vector>

#include "compression/cuda/kernels.h"

using namespace meridian::compression;

static double Time(const std::function<void()>& f, int reps) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  f();
  cudaEventRecord(a);
  for (int i = 0; i < reps; ++i) f();
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  return ms / 1e3 / reps;
}

int main() {
  if (!cuda::DeviceAvailable()) {
    std::printf("gpu_bench: no CUDA device\n");
    return 0;
  }
  const int64_t n = 256 << 20;  // 1 GiB of float32
  float *x, *y;
  uint8_t* p;
  int* bad;
  uint32_t* idx;
  cudaMalloc(&x, n * 4), cudaMalloc(&y, n * 4), cudaMalloc(&p, n + n / 16 + 64), cudaMalloc(&bad, 4);
  cudaMalloc(&idx, n * 4);
  std::vector<float> h(1 << 20);
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<float>((i * 2654435761u) % 2000) / 1000.0f - 1.0f;
  for (int64_t off = 0; off < n; off += h.size()) cudaMemcpy(x + off, h.data(), h.size() * 4, cudaMemcpyHostToDevice);
  const double bytes = n * 4.0;
  double copy = Time([&] { cudaMemcpy(y, x, n * 4, cudaMemcpyDeviceToDevice); }, 10);
  double q8 = Time([&] { cuda::QuantizeInt8(x, n, 64, p, bad, nullptr); }, 10);
  double d8 = Time([&] { cuda::DequantizeInt8(p, n, 64, y, nullptr); }, 10);
  double q4 = Time([&] { cuda::QuantizeInt4(x, n, 64, p, bad, nullptr); }, 10);
  double d4 = Time([&] { cuda::DequantizeInt4(p, n, 64, y, nullptr); }, 10);
  float t = 0;
  cuda::EstimateThreshold(x, n, 0.01, &t, nullptr);
  int64_t count = 0;
  double tk = Time([&] { cuda::SelectAboveThreshold(x, n, t, idx, y, &count, nullptr); }, 5);
  std::printf("%-28s %8.1f GB/s of input\n", "device-to-device copy", bytes / copy / 1e9);
  std::printf("%-28s %8.1f GB/s (%.0f%% of copy)\n", "int8 quantise", bytes / q8 / 1e9, 100 * copy / q8);
  std::printf("%-28s %8.1f GB/s (%.0f%% of copy)\n", "int8 dequantise", bytes / d8 / 1e9, 100 * copy / d8);
  std::printf("%-28s %8.1f GB/s (%.0f%% of copy)\n", "int4 quantise", bytes / q4 / 1e9, 100 * copy / q4);
  std::printf("%-28s %8.1f GB/s (%.0f%% of copy)\n", "int4 dequantise", bytes / d4 / 1e9, 100 * copy / d4);
  std::printf("%-28s %8.1f GB/s (%.0f%% of copy), kept %.3f%%\n", "top-1% threshold select", bytes / tk / 1e9,
              100 * copy / tk, 100.0 * count / n);
  return 0;
}
