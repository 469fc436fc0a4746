// A non-owning view of a dense tensor: dtype, shape and bytes. The common currency between the
// executor (which makes views of at::Tensor after .contiguous()) and the pure codecs in compression/.
// A view is thread-compatible; the caller keeps the bytes alive while the view is used.
#ifndef MERIDIAN_CORE_TENSOR_VIEW_H_
#define MERIDIAN_CORE_TENSOR_VIEW_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace meridian::core {

// Values are part of the wire format (compression frames): never renumber.
enum class DType : uint8_t { kFloat32 = 1, kFloat16 = 2, kBFloat16 = 3, kInt8 = 4, kInt32 = 5, kInt64 = 6, kUInt8 = 7 };

// Bytes per element; 0 for an unknown value (e.g. a corrupt frame).
inline size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kInt8:
    case DType::kUInt8:
      return 1;
    case DType::kInt64:
      return 8;
  }
  return 0;
}
const char* DTypeName(DType t);
inline bool IsFloating(DType t) { return t == DType::kFloat32 || t == DType::kFloat16 || t == DType::kBFloat16; }

struct TensorView {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // numel() * DTypeSize(dtype) bytes, not owned

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  size_t nbytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype); }
};

// An owning tensor buffer, e.g. the result of decoding a frame.
struct Tensor {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;

  TensorView view() const { return {dtype, shape, bytes.data()}; }
  template <typename T>
  T* data() {
    return reinterpret_cast<T*>(bytes.data());
  }
  template <typename T>
  const T* data() const {
    return reinterpret_cast<const T*>(bytes.data());
  }
  int64_t numel() const { return view().numel(); }
};

// IEEE half and bfloat16 conversions (round to nearest even). Pure, thread-safe.
inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t FloatToBFloat16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float BFloat16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

uint16_t FloatToHalf(float f);
float HalfToFloat(uint16_t h);

// Converts n elements of a floating dtype to float32 / from float32.
void ToFloat32(DType t, const void* src, float* dst, size_t n);
void FromFloat32(DType t, const float* src, void* dst, size_t n);

}  // namespace meridian::core

#endif  // MERIDIAN_CORE_TENSOR_VIEW_H_
