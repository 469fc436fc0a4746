// CUDA kernels of the compression library: int8/int4 blockwise quantise/dequantise producing exactly
// the CPU codecs' payload layout (scales, then codes), and threshold-based top-k selection.
// No CUDA types in this header: streams are passed as void* (a cudaStream_t), errors as the
// cudaError_t value (0 = success; ErrorName() describes it). All pointers are device memory unless
// stated. Thread-safe: kernels touch only the buffers they are given.
#ifndef MERIDIAN_COMPRESSION_CUDA_KERNELS_H_
#define MERIDIAN_COMPRESSION_CUDA_KERNELS_H_

#include <cstdint>

namespace meridian::compression::cuda {

// True when a CUDA device can be used (driver present and at least one device).
bool DeviceAvailable();
const char* ErrorName(int error);

// payload: 4 * ceil(n / block) bytes of float32 scales, then n int8 codes (int8) or ceil(n / 2) bytes of
// packed 4-bit codes (int4, low nibble first, code + 8). REQUIRES block even, 2 <= block <= 1024.
// Non-finite input sets *bad_flag (device int, caller zeroes it) to 1; the codes are then meaningless.
int QuantizeInt8(const float* x, int64_t n, int block, uint8_t* payload, int* bad_flag, void* stream);
int DequantizeInt8(const uint8_t* payload, int64_t n, int block, float* out, void* stream);
int QuantizeInt4(const float* x, int64_t n, int block, uint8_t* payload, int* bad_flag, void* stream);
int DequantizeInt4(const uint8_t* payload, int64_t n, int block, float* out, void* stream);

// Keeps the elements with |x| >= threshold, in index order: writes their indices and values and the
// count (host int64). `indices` and `values` must hold n entries (the worst case). Uses CUB's
// order-preserving selection. A threshold from EstimateThreshold keeps about fraction * n elements.
int SelectAboveThreshold(const float* x, int64_t n, float threshold, uint32_t* indices, float* values, int64_t* count,
                         void* stream);

// The |x| threshold that keeps about `fraction` of n elements, from a strided sample of 16384 values
// (the same estimate the CPU top-k codec starts from). Synchronises the stream.
int EstimateThreshold(const float* x, int64_t n, double fraction, float* threshold, void* stream);

}  // namespace meridian::compression::cuda

#endif  // MERIDIAN_COMPRESSION_CUDA_KERNELS_H_
