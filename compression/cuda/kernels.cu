#include "compression/cuda/kernels.h"

#include <thrust/iterator/counting_iterator.h>
#include <cub/device/device_select.cuh>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

namespace meridian::compression::cuda {
namespace {

__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// One thread block per quantisation block; blockDim.x = 32 * warps; each thread covers a strided part.
template <bool kInt4>
__global__ void QuantizeKernel(const float* __restrict__ x, int64_t n, int block, uint8_t* __restrict__ payload,
                               int* bad_flag, int64_t nblocks) {
  const int64_t b = blockIdx.x;
  const int64_t b0 = b * block;
  const int len = static_cast<int>(n - b0 < block ? n - b0 : block);
  float m = 0.0f;
  bool bad = false;
  for (int i = threadIdx.x; i < len; i += blockDim.x) {
    float a = fabsf(x[b0 + i]);
    bad |= !(a <= 3.402823466e38f);
    m = fmaxf(m, a);
  }
  __shared__ float warp_max[32];
  m = WarpMax(m);
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  if (bad) atomicExch(bad_flag, 1);
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < (blockDim.x >> 5) ? warp_max[threadIdx.x] : 0.0f;
    v = WarpMax(v);
    if (threadIdx.x == 0) warp_max[0] = v;
  }
  __syncthreads();
  const float amax = warp_max[0];
  const float qmax = kInt4 ? 7.0f : 127.0f;
  // Same arithmetic as the CPU codec: scale = amax / qmax, code = rint(x * (qmax / amax)).
  const float inv = amax > 0.0f ? qmax / amax : 0.0f;
  if (threadIdx.x == 0) reinterpret_cast<float*>(payload)[b] = amax / qmax;
  uint8_t* codes = payload + 4 * nblocks;
  if (!kInt4) {
    for (int i = threadIdx.x; i < len; i += blockDim.x)
      reinterpret_cast<int8_t*>(codes)[b0 + i] = static_cast<int8_t>(__float2int_rn(x[b0 + i] * inv));
  } else {
    for (int i = 2 * threadIdx.x; i < len; i += 2 * blockDim.x) {
      int lo = __float2int_rn(x[b0 + i] * inv) + 8;
      int hi = i + 1 < len ? __float2int_rn(x[b0 + i + 1] * inv) + 8 : 8;
      codes[(b0 + i) / 2] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

template <bool kInt4>
__global__ void DequantizeKernel(const uint8_t* __restrict__ payload, int64_t n, int block, float* __restrict__ out,
                                 int64_t nblocks) {
  const uint8_t* codes = payload + 4 * nblocks;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = reinterpret_cast<const float*>(payload)[i / block];
    int v;
    if (kInt4) {
      uint8_t byte = codes[i / 2];
      v = ((i & 1) ? (byte >> 4) : (byte & 15)) - 8;
    } else {
      v = reinterpret_cast<const int8_t*>(codes)[i];
    }
    out[i] = static_cast<float>(v) * s;
  }
}

__global__ void SampleKernel(const float* x, int64_t stride, int samples, float* out) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < samples) out[i] = fabsf(x[i * stride]);
}

struct AboveThreshold {
  const float* x;
  float t;
  __device__ bool operator()(uint32_t i) const { return fabsf(x[i]) >= t; }
};

__global__ void GatherKernel(const float* x, const uint32_t* idx, const int64_t* count, float* values) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < *count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    values[i] = x[idx[i]];
}

int Grid(int64_t n, int threads) { return static_cast<int>(std::min<int64_t>((n + threads - 1) / threads, 65535)); }

int64_t Blocks(int64_t n, int block) { return (n + block - 1) / block; }

template <bool kInt4>
int Quantize(const float* x, int64_t n, int block, uint8_t* payload, int* bad_flag, void* stream) {
  if (n == 0) return cudaSuccess;
  if (block < 2 || block > 1024 || block % 2) return cudaErrorInvalidValue;
  const int64_t nb = Blocks(n, block);
  if (nb > 2147483647) return cudaErrorInvalidValue;
  int threads = std::min(256, std::max(32, ((block / (kInt4 ? 2 : 1)) + 31) / 32 * 32));
  QuantizeKernel<kInt4><<<static_cast<unsigned>(nb), threads, 0, static_cast<cudaStream_t>(stream)>>>(
      x, n, block, payload, bad_flag, nb);
  return cudaGetLastError();
}

template <bool kInt4>
int Dequantize(const uint8_t* payload, int64_t n, int block, float* out, void* stream) {
  if (n == 0) return cudaSuccess;
  DequantizeKernel<kInt4>
      <<<Grid(n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(payload, n, block, out, Blocks(n, block));
  return cudaGetLastError();
}

}  // namespace

bool DeviceAvailable() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

const char* ErrorName(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

int QuantizeInt8(const float* x, int64_t n, int block, uint8_t* payload, int* bad, void* s) {
  return Quantize<false>(x, n, block, payload, bad, s);
}
int DequantizeInt8(const uint8_t* payload, int64_t n, int block, float* out, void* s) {
  return Dequantize<false>(payload, n, block, out, s);
}
int QuantizeInt4(const float* x, int64_t n, int block, uint8_t* payload, int* bad, void* s) {
  return Quantize<true>(x, n, block, payload, bad, s);
}
int DequantizeInt4(const uint8_t* payload, int64_t n, int block, float* out, void* s) {
  return Dequantize<true>(payload, n, block, out, s);
}

int EstimateThreshold(const float* x, int64_t n, double fraction, float* threshold, void* stream) {
  auto st = static_cast<cudaStream_t>(stream);
  if (n <= 0) return cudaErrorInvalidValue;
  const int samples = static_cast<int>(std::min<int64_t>(n, 16384));
  const int64_t stride = n / samples;
  float* d = nullptr;
  int err = cudaMallocAsync(&d, samples * sizeof(float), st);
  if (err) return err;
  SampleKernel<<<(samples + 255) / 256, 256, 0, st>>>(x, stride, samples, d);
  std::vector<float> h(samples);
  err = cudaMemcpyAsync(h.data(), d, samples * sizeof(float), cudaMemcpyDeviceToHost, st);
  if (!err) err = cudaStreamSynchronize(st);
  cudaFreeAsync(d, st);
  if (err) return err;
  int rank = static_cast<int>(std::min<double>(samples - 1, fraction * samples));
  std::nth_element(h.begin(), h.begin() + rank, h.end(), std::greater<float>());
  *threshold = h[rank];
  return cudaSuccess;
}

int SelectAboveThreshold(const float* x, int64_t n, float threshold, uint32_t* indices, float* values, int64_t* count,
                         void* stream) {
  auto st = static_cast<cudaStream_t>(stream);
  if (n > 4294967295LL) return cudaErrorInvalidValue;
  thrust::counting_iterator<uint32_t> it(0);
  int64_t* d_count = nullptr;
  void* temp = nullptr;
  size_t temp_bytes = 0;
  int err = cub::DeviceSelect::If(nullptr, temp_bytes, it, indices, d_count, static_cast<int>(n),
                                  AboveThreshold{x, threshold}, st);
  if (err) return err;
  // One allocation: CUB's scratch space, then the 8-byte-aligned selected-count.
  const size_t count_offset = (temp_bytes + 7) / 8 * 8;
  err = cudaMallocAsync(&temp, count_offset + sizeof(int64_t), st);
  if (err) return err;
  d_count = reinterpret_cast<int64_t*>(static_cast<char*>(temp) + count_offset);
  err = cub::DeviceSelect::If(temp, temp_bytes, it, indices, d_count, static_cast<int>(n), AboveThreshold{x, threshold},
                              st);
  if (!err) {
    GatherKernel<<<Grid(n, 256), 256, 0, st>>>(x, indices, d_count, values);
    err = cudaGetLastError();
  }
  if (!err) err = cudaMemcpyAsync(count, d_count, sizeof(int64_t), cudaMemcpyDeviceToHost, st);
  if (!err) err = cudaStreamSynchronize(st);
  cudaFreeAsync(temp, st);
  return err;
}

}  // namespace meridian::compression::cuda
