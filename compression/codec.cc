#include "compression/codec.h"

#include <zstd.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "compression/internal/crc32c.h"

namespace meridian::compression {

namespace {

int64_t TopkCount(double fraction, int64_t n) {
  if (n == 0) return 0;
  return std::clamp<int64_t>(static_cast<int64_t>(std::ceil(fraction * static_cast<double>(n))), 1, n);
}

// The run of elements top-k `spec` picks within: its chunk, or all `n` when it has none (or a larger one).
int64_t TopkChunk(const CodecSpec& spec, int64_t n) {
  return spec.topk_chunk > 0 && spec.topk_chunk < n ? spec.topk_chunk : n;
}

// How many top-k `spec` keeps of `n`: TopkCount of each chunk, summed.
int64_t TopkCount(const CodecSpec& spec, int64_t n) {
  const int64_t chunk = TopkChunk(spec, n);
  if (chunk == n) return TopkCount(spec.topk_fraction, n);
  return n / chunk * TopkCount(spec.topk_fraction, chunk) + TopkCount(spec.topk_fraction, n % chunk);
}

using core::DType;

constexpr uint8_t kMagic[4] = {'M', 'R', 'D', 'F'};
constexpr uint8_t kVersion = 1;
constexpr size_t kHeaderBytes = 56;
constexpr int kMaxDims = 8;
constexpr uint8_t kFlagZstd = 1, kFlagTopkInt8 = 2, kFlagBitmap = 4;
using core::kMinTopkFraction;

template <typename T>
void Put(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof v);
}
template <typename T>
T Get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

int64_t Blocks(int64_t n, int block) { return (n + block - 1) / block; }

absl::Status Corrupt(const std::string& what) { return absl::DataLossError(absl::StrCat("bad frame: ", what)); }

// ---- quantisation kernels (plain loops the compiler vectorises at -O3) ----

// Returns false if any value in the block is NaN or infinite.
bool AbsMax(const float* x, int64_t n, float* out) {
  float m = 0;
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    float a = std::fabs(x[i]);
    m = a > m ? a : m;
    bad |= !(a <= std::numeric_limits<float>::max());
  }
  *out = m;
  return !bad;
}

#if defined(__SSE2__)
// SSE2 (every x86-64 CPU): 16 elements per step; cvtps2dq rounds to nearest even like rintf, so the
// results equal the scalar path bit for bit.
bool AbsMaxSse2(const float* x, int64_t n, float* out) {
  const __m128 sign = _mm_set1_ps(-0.0f), fmax = _mm_set1_ps(std::numeric_limits<float>::max());
  // Four independent accumulators hide maxps latency.
  __m128 m0 = _mm_setzero_ps(), m1 = m0, m2 = m0, m3 = m0;
  __m128 ok = _mm_castsi128_ps(_mm_set1_epi32(-1));
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m128 a = _mm_andnot_ps(sign, _mm_loadu_ps(x + i)), b = _mm_andnot_ps(sign, _mm_loadu_ps(x + i + 4));
    __m128 c = _mm_andnot_ps(sign, _mm_loadu_ps(x + i + 8)), d = _mm_andnot_ps(sign, _mm_loadu_ps(x + i + 12));
    ok = _mm_and_ps(ok, _mm_and_ps(_mm_and_ps(_mm_cmple_ps(a, fmax), _mm_cmple_ps(b, fmax)),
                                   _mm_and_ps(_mm_cmple_ps(c, fmax), _mm_cmple_ps(d, fmax))));  // false for NaN, Inf
    m0 = _mm_max_ps(m0, a);
    m1 = _mm_max_ps(m1, b);
    m2 = _mm_max_ps(m2, c);
    m3 = _mm_max_ps(m3, d);
  }
  __m128 m = _mm_max_ps(_mm_max_ps(m0, m1), _mm_max_ps(m2, m3));
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, m);
  float mx = std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
  bool good = _mm_movemask_ps(ok) == 0xf;
  float tail;
  good &= AbsMax(x + i, n - i, &tail);
  *out = std::max(mx, tail);
  return good;
}

void QuantizeBlockInt8(const float* x, int64_t n, float inv, int8_t* q) {
  const __m128 vinv = _mm_set1_ps(inv);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m128i a = _mm_cvtps_epi32(_mm_mul_ps(_mm_loadu_ps(x + i), vinv));
    __m128i b = _mm_cvtps_epi32(_mm_mul_ps(_mm_loadu_ps(x + i + 4), vinv));
    __m128i c = _mm_cvtps_epi32(_mm_mul_ps(_mm_loadu_ps(x + i + 8), vinv));
    __m128i d = _mm_cvtps_epi32(_mm_mul_ps(_mm_loadu_ps(x + i + 12), vinv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(_mm_packs_epi32(a, b), _mm_packs_epi32(c, d)));
  }
  for (; i < n; ++i) q[i] = static_cast<int8_t>(__builtin_rintf(x[i] * inv));
}

// `stream`: write with non-temporal stores (for outputs far larger than the cache; REQUIRES out 16-byte
// aligned), as large memcpys do, which saves the read-for-ownership of every output line.
template <bool stream>
void DequantizeBlockInt8(const int8_t* q, int64_t n, float s, float* out) {
  const __m128 vs = _mm_set1_ps(s);
  int64_t i = 0;
  auto store = [](float* p, __m128 v) {
    if constexpr (stream)
      _mm_stream_ps(p, v);
    else
      _mm_storeu_ps(p, v);
  };
  for (; i + 16 <= n; i += 16) {
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i));
    __m128i lo = _mm_srai_epi16(_mm_unpacklo_epi8(v, v), 8), hi = _mm_srai_epi16(_mm_unpackhi_epi8(v, v), 8);
    __m128i w0 = _mm_srai_epi32(_mm_unpacklo_epi16(lo, lo), 16), w1 = _mm_srai_epi32(_mm_unpackhi_epi16(lo, lo), 16);
    __m128i w2 = _mm_srai_epi32(_mm_unpacklo_epi16(hi, hi), 16), w3 = _mm_srai_epi32(_mm_unpackhi_epi16(hi, hi), 16);
    store(out + i, _mm_mul_ps(_mm_cvtepi32_ps(w0), vs));
    store(out + i + 4, _mm_mul_ps(_mm_cvtepi32_ps(w1), vs));
    store(out + i + 8, _mm_mul_ps(_mm_cvtepi32_ps(w2), vs));
    store(out + i + 12, _mm_mul_ps(_mm_cvtepi32_ps(w3), vs));
  }
  for (; i < n; ++i) out[i] = static_cast<float>(q[i]) * s;
}
#else
bool AbsMaxSse2(const float* x, int64_t n, float* out) { return AbsMax(x, n, out); }
void QuantizeBlockInt8(const float* x, int64_t n, float inv, int8_t* q) {
  for (int64_t i = 0; i < n; ++i) q[i] = static_cast<int8_t>(__builtin_rintf(x[i] * inv));
}
template <bool stream>
void DequantizeBlockInt8(const int8_t* q, int64_t n, float s, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(q[i]) * s;
}
#endif

absl::Status QuantizeInt8(const float* x, int64_t n, int block, uint8_t* payload) {
  uint8_t* scales = payload;
  int8_t* q = reinterpret_cast<int8_t*>(payload + 4 * Blocks(n, block));
  for (int64_t b0 = 0, bi = 0; b0 < n; b0 += block, ++bi) {
    int64_t len = std::min<int64_t>(block, n - b0);
    float amax;
    if (!AbsMaxSse2(x + b0, len, &amax))
      return absl::InvalidArgumentError(absl::StrCat("non-finite value in elements [", b0, ", ", b0 + len, ")"));
    Put(scales + 4 * bi, amax / 127.0f);
    QuantizeBlockInt8(x + b0, len, amax > 0 ? 127.0f / amax : 0.0f, q + b0);
  }
  return absl::OkStatus();
}

void DequantizeInt8(const uint8_t* payload, int64_t n, int block, float* out) {
  const uint8_t* scales = payload;
  const int8_t* q = reinterpret_cast<const int8_t*>(payload + 4 * Blocks(n, block));
  // Streaming stores pay off once the output is well beyond the last-level cache share of one core.
  const bool stream = n * 4 >= (int64_t{8} << 20) && reinterpret_cast<uintptr_t>(out) % 16 == 0 && block % 4 == 0;
  for (int64_t b0 = 0, bi = 0; b0 < n; b0 += block, ++bi) {
    int64_t len = std::min<int64_t>(block, n - b0);
    if (stream)
      DequantizeBlockInt8<true>(q + b0, len, Get<float>(scales + 4 * bi), out + b0);
    else
      DequantizeBlockInt8<false>(q + b0, len, Get<float>(scales + 4 * bi), out + b0);
  }
#if defined(__SSE2__)
  if (stream) _mm_sfence();
#endif
}

absl::Status QuantizeInt4(const float* x, int64_t n, int block, uint8_t* payload) {
  uint8_t* scales = payload;
  uint8_t* q = payload + 4 * Blocks(n, block);
  std::memset(q, 0, static_cast<size_t>((n + 1) / 2));
  for (int64_t b0 = 0, bi = 0; b0 < n; b0 += block, ++bi) {
    int64_t len = std::min<int64_t>(block, n - b0);
    float amax;
    if (!AbsMaxSse2(x + b0, len, &amax))
      return absl::InvalidArgumentError(absl::StrCat("non-finite value in elements [", b0, ", ", b0 + len, ")"));
    Put(scales + 4 * bi, amax / 7.0f);
    float inv = amax > 0 ? 7.0f / amax : 0.0f;
    // block is even, so b0 is even and pairs never straddle blocks.
    for (int64_t i = 0; i < len; i += 2) {
      int lo = static_cast<int>(__builtin_rintf(x[b0 + i] * inv)) + 8;
      int hi = i + 1 < len ? static_cast<int>(__builtin_rintf(x[b0 + i + 1] * inv)) + 8 : 8;
      q[(b0 + i) / 2] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
  return absl::OkStatus();
}

void DequantizeInt4(const uint8_t* payload, int64_t n, int block, float* out) {
  const uint8_t* scales = payload;
  const uint8_t* q = payload + 4 * Blocks(n, block);
  for (int64_t b0 = 0, bi = 0; b0 < n; b0 += block, ++bi) {
    int64_t len = std::min<int64_t>(block, n - b0);
    float s = Get<float>(scales + 4 * bi);
    for (int64_t i = 0; i < len; ++i) {
      uint8_t byte = q[(b0 + i) / 2];
      int v = ((i & 1) ? (byte >> 4) : (byte & 15)) - 8;
      out[b0 + i] = static_cast<float>(v) * s;
    }
  }
}

// int2: four levels per block, (2c - 3) x the block's scale for code c in 0..3 (no zero: meant for AQ-SGD's
// activation deltas, whose blocks rarely sit at zero); four codes a byte, element i at bits 2 (i % 4), bits
// past the last element zero. Four levels spread to the block's absmax (scale absmax / 3) leave most of a
// bell-shaped block between the inner levels, so the encoder picks the scale, among kInt2ScaleFractions of
// absmax / 3, whose codes (clamped to 0..3) leave the least squared error in the block: the decoder needs
// only the scale (in a pipeline, int2-delta activations: +13.9% loss after 300 steps against +29.5% with
// absmax / 3, bench/RESULTS.md).
constexpr float kInt2ScaleFractions[] = {1.0f, 0.85f, 0.7f, 0.6f, 0.5f, 0.42f, 0.35f};

// The int2 code of x at `scale`'s reciprocal `inv`.
inline int Int2Code(float x, float inv) {
  const int c = static_cast<int>(__builtin_rintf((x * inv + 3.0f) * 0.5f));
  return c < 0 ? 0 : (c > 3 ? 3 : c);
}

absl::Status QuantizeInt2(const float* x, int64_t n, int block, uint8_t* payload) {
  uint8_t* scales = payload;
  uint8_t* q = payload + 4 * Blocks(n, block);
  std::memset(q, 0, static_cast<size_t>((n + 3) / 4));
  for (int64_t b0 = 0, bi = 0; b0 < n; b0 += block, ++bi) {
    int64_t len = std::min<int64_t>(block, n - b0);
    float amax;
    if (!AbsMaxSse2(x + b0, len, &amax))
      return absl::InvalidArgumentError(absl::StrCat("non-finite value in elements [", b0, ", ", b0 + len, ")"));
    float scale = amax / 3.0f;
    double least = -1;
    for (float f : kInt2ScaleFractions) {
      const float s = amax / 3.0f * f, inv = s > 0 ? 1.0f / s : 0.0f;
      double error = 0;
      for (int64_t i = 0; i < len; ++i) {
        const double d = x[b0 + i] - static_cast<float>(2 * Int2Code(x[b0 + i], inv) - 3) * s;
        error += d * d;
      }
      if (least < 0 || error < least) least = error, scale = s;
    }
    Put(scales + 4 * bi, scale);
    const float inv = scale > 0 ? 1.0f / scale : 0.0f;
    for (int64_t i = 0; i < len; ++i)
      q[(b0 + i) / 4] |= static_cast<uint8_t>(Int2Code(x[b0 + i], inv) << (2 * ((b0 + i) % 4)));
  }
  return absl::OkStatus();
}

void DequantizeInt2(const uint8_t* payload, int64_t n, int block, float* out) {
  const uint8_t* scales = payload;
  const uint8_t* q = payload + 4 * Blocks(n, block);
  for (int64_t b0 = 0, bi = 0; b0 < n; b0 += block, ++bi) {
    int64_t len = std::min<int64_t>(block, n - b0);
    float s = Get<float>(scales + 4 * bi);
    for (int64_t i = 0; i < len; ++i) {
      int c = (q[(b0 + i) / 4] >> (2 * ((b0 + i) % 4))) & 3;
      out[b0 + i] = static_cast<float>(2 * c - 3) * s;
    }
  }
}

// A block scale is valid when it is finite, non-negative and small enough that every code times it stays
// finite (codes are at most 128 in magnitude): a forged scale cannot make a decoded value infinite.
constexpr float kMaxScale = std::numeric_limits<float>::max() / 128.0f;
bool ScalesValid(const uint8_t* scales, int64_t blocks) {
  for (int64_t i = 0; i < blocks; ++i) {
    float s = Get<float>(scales + 4 * i);
    if (!(s >= 0 && s <= kMaxScale)) return false;
  }
  return true;
}

// fp16 encoding saturates at the largest finite half (65504) instead of overflowing to infinity.
absl::Status EncodeFp16Saturating(const float* x, int64_t n, uint8_t* out) {
  constexpr float kHalfMax = 65504.0f;
  constexpr int64_t kChunk = 4096;
  float clamped[kChunk];
  for (int64_t b0 = 0; b0 < n; b0 += kChunk) {
    const int64_t len = std::min(kChunk, n - b0);
    float amax;
    if (!AbsMax(x + b0, len, &amax))
      return absl::InvalidArgumentError(absl::StrCat("non-finite value in elements [", b0, ", ", b0 + len, ")"));
    const float* src = x + b0;
    if (amax > kHalfMax) {
      for (int64_t i = 0; i < len; ++i) clamped[i] = std::clamp(src[i], -kHalfMax, kHalfMax);
      src = clamped;
    }
    core::FromFloat32(DType::kFloat16, src, out + 2 * b0, static_cast<size_t>(len));
  }
  return absl::OkStatus();
}

// ---- top-k ----

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 128) v >>= 7, ++n;
  return n;
}
uint8_t* PutVarint(uint8_t* p, uint64_t v) {
  while (v >= 128) *p++ = static_cast<uint8_t>(v | 128), v >>= 7;
  *p++ = static_cast<uint8_t>(v);
  return p;
}

// Indices (ascending) of the k largest |x|. A strided sample estimates a threshold a little below the
// k-th magnitude; one pass collects the candidates above it, and nth_element trims them to exactly k.
std::vector<uint32_t> TopkIndices(const float* x, int64_t n, int64_t k) {
  std::vector<uint32_t> idx;
  if (k >= n) {
    idx.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) idx[i] = static_cast<uint32_t>(i);
    return idx;
  }
  float threshold = 0;
  if (n > 65536) {
    const int64_t samples = 16384, stride = n / samples;
    std::vector<float> s(samples);
    for (int64_t i = 0; i < samples; ++i) s[i] = std::fabs(x[i * stride]);
    // Aim for about 1.5k candidates (plus slack for sampling error), never fewer than k on average.
    int64_t rank = std::min<int64_t>(samples - 1, static_cast<int64_t>(1.5 * samples * k / n) + 8);
    std::nth_element(s.begin(), s.begin() + rank, s.end(), std::greater<float>());
    threshold = s[rank];
  }
  std::vector<uint32_t> cand;
  cand.reserve(static_cast<size_t>(std::min<int64_t>(n, 2 * k + 1024)));
  for (int64_t i = 0; i < n; ++i)
    if (std::fabs(x[i]) >= threshold) cand.push_back(static_cast<uint32_t>(i));
  if (static_cast<int64_t>(cand.size()) < k) {  // the sample overestimated the threshold: take everything
    cand.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) cand[i] = static_cast<uint32_t>(i);
  }
  if (static_cast<int64_t>(cand.size()) > k) {
    std::vector<float> mags(cand.size());
    for (size_t i = 0; i < cand.size(); ++i) mags[i] = std::fabs(x[cand[i]]);
    std::nth_element(mags.begin(), mags.begin() + (k - 1), mags.end(), std::greater<float>());
    float kth = mags[k - 1];
    int64_t above = 0;
    for (float m : mags) above += m > kth;
    int64_t ties = k - above;  // how many equal to kth we may keep, first come first served
    for (uint32_t i : cand) {
      float m = std::fabs(x[i]);
      if (m > kth || (m == kth && ties-- > 0)) idx.push_back(i);
    }
  } else {
    idx = std::move(cand);
  }
  return idx;
}

// ---- frame assembly ----

struct Header {
  CodecKind kind;
  DType dtype;
  uint8_t flags;
  int block;
  std::vector<int64_t> shape;
  int64_t numel;
  int64_t count;
  uint64_t payload_len, raw_len;
};

size_t HeaderSize(size_t ndim) { return kHeaderBytes + 8 * ndim; }

void WriteHeader(const Header& h, uint8_t* p) {
  std::memcpy(p, kMagic, 4);
  p[4] = kVersion;
  p[5] = static_cast<uint8_t>(h.kind);
  p[6] = static_cast<uint8_t>(h.dtype);
  p[7] = h.flags;
  p[8] = static_cast<uint8_t>(h.shape.size());
  p[9] = p[10] = p[11] = 0;
  Put<uint32_t>(p + 12, static_cast<uint32_t>(h.block));
  Put<int64_t>(p + 16, h.numel);
  Put<int64_t>(p + 24, h.count);
  Put<uint64_t>(p + 32, h.payload_len);
  Put<uint64_t>(p + 40, h.raw_len);
  Put<uint32_t>(p + 48, 0);
  Put<uint32_t>(p + 52, 0);
  for (size_t i = 0; i < h.shape.size(); ++i) Put<int64_t>(p + kHeaderBytes + 8 * i, h.shape[i]);
}

uint32_t FrameChecksum(const uint8_t* frame, size_t header_size, const uint8_t* payload, size_t payload_len) {
  uint32_t crc = internal::Crc32c(0, frame, 48);
  crc = internal::Crc32c(crc, frame + 52, header_size - 52);
  return internal::Crc32cStriped(crc, payload, payload_len);
}

// Raw payload size for a codec; for top-k, `index_bytes` of the chosen index encoding.
uint64_t RawPayloadSize(const Header& h, uint64_t index_bytes) {
  const int64_t n = h.numel;
  switch (h.kind) {
    case CodecKind::kIdentity:
      return static_cast<uint64_t>(n) * core::DTypeSize(h.dtype);
    case CodecKind::kFp16:
    case CodecKind::kBf16:
      return static_cast<uint64_t>(n) * 2;
    case CodecKind::kInt8:
      return static_cast<uint64_t>(4 * Blocks(n, h.block) + n);
    case CodecKind::kInt4:
      return static_cast<uint64_t>(4 * Blocks(n, h.block) + (n + 1) / 2);
    case CodecKind::kInt2:
      return static_cast<uint64_t>(4 * Blocks(n, h.block) + (n + 3) / 4);
    case CodecKind::kTopK: {
      uint64_t values = (h.flags & kFlagTopkInt8) ? static_cast<uint64_t>(4 * Blocks(h.count, h.block) + h.count)
                                                  : static_cast<uint64_t>(4 * h.count);
      return 8 + index_bytes + values;
    }
  }
  return 0;
}

absl::Status EncodeFloat(const float* x, const std::vector<int64_t>& shape, int64_t n, DType out_dtype,
                         const CodecSpec& spec, const void* raw_input, std::vector<uint8_t>* frame) {
  Header h{spec.kind, out_dtype, 0, spec.block_size, shape, n, 0, 0, 0};
  std::vector<uint32_t> idx;
  uint64_t index_bytes = 0;
  bool bitmap = false;
  if (spec.kind == CodecKind::kTopK) {
    h.count = TopkCount(spec, n);
    if (const int64_t chunk = TopkChunk(spec, n); chunk == n) {
      idx = TopkIndices(x, n, h.count);
    } else {  // each chunk's largest, in ascending order as the chunks are
      idx.reserve(static_cast<size_t>(h.count));
      for (int64_t c = 0; c < n; c += chunk) {
        const int64_t len = std::min<int64_t>(chunk, n - c);
        for (uint32_t i : TopkIndices(x + c, len, TopkCount(spec.topk_fraction, len)))
          idx.push_back(static_cast<uint32_t>(c + i));
      }
    }
    uint64_t varint = 0;
    for (size_t i = 0, prev = 0; i < idx.size(); ++i) {
      varint += VarintSize(idx[i] - (i ? prev + 1 : 0));
      prev = idx[i];
    }
    uint64_t bm = static_cast<uint64_t>((n + 7) / 8);
    bitmap = bm < varint;
    index_bytes = bitmap ? bm : varint;
    if (bitmap) h.flags |= kFlagBitmap;
    if (spec.topk_int8_values) h.flags |= kFlagTopkInt8;
  }
  h.raw_len = RawPayloadSize(h, index_bytes);
  const size_t hs = HeaderSize(shape.size());
  // Without zstd the payload is written straight into the frame; with it, into a scratch buffer first.
  std::vector<uint8_t> scratch;
  if (spec.zstd) {
    scratch.resize(h.raw_len);
  } else {
    frame->resize(hs + h.raw_len);
  }
  uint8_t* p = spec.zstd ? scratch.data() : frame->data() + hs;
  switch (spec.kind) {
    case CodecKind::kIdentity:
      std::memcpy(p, raw_input ? raw_input : static_cast<const void*>(x), h.raw_len);
      break;
    case CodecKind::kFp16: {
      absl::Status s = EncodeFp16Saturating(x, n, p);
      if (!s.ok()) return s;
      break;
    }
    case CodecKind::kBf16:
      core::FromFloat32(DType::kBFloat16, x, p, static_cast<size_t>(n));
      break;
    case CodecKind::kInt8: {
      absl::Status s = QuantizeInt8(x, n, spec.block_size, p);
      if (!s.ok()) return s;
      break;
    }
    case CodecKind::kInt4: {
      absl::Status s = QuantizeInt4(x, n, spec.block_size, p);
      if (!s.ok()) return s;
      break;
    }
    case CodecKind::kInt2: {
      absl::Status s = QuantizeInt2(x, n, spec.block_size, p);
      if (!s.ok()) return s;
      break;
    }
    case CodecKind::kTopK: {
      Put<uint64_t>(p, index_bytes);
      uint8_t* q = p + 8;
      if (bitmap) {
        std::memset(q, 0, index_bytes);
        for (uint32_t i : idx) q[i >> 3] |= static_cast<uint8_t>(1u << (i & 7));
        q += index_bytes;
      } else {
        for (size_t i = 0, prev = 0; i < idx.size(); ++i) {
          q = PutVarint(q, idx[i] - (i ? prev + 1 : 0));
          prev = idx[i];
        }
      }
      std::vector<float> vals(idx.size());
      for (size_t i = 0; i < idx.size(); ++i) vals[i] = x[idx[i]];
      for (float v : vals)
        if (!std::isfinite(v)) return absl::InvalidArgumentError("non-finite value among the top-k elements");
      if (spec.topk_int8_values) {
        absl::Status s = QuantizeInt8(vals.data(), static_cast<int64_t>(vals.size()), spec.block_size, q);
        if (!s.ok()) return s;
      } else {
        std::memcpy(q, vals.data(), 4 * vals.size());
      }
      break;
    }
  }
  h.payload_len = h.raw_len;
  if (spec.zstd) {
    frame->resize(hs + ZSTD_compressBound(h.raw_len));
    size_t z = h.raw_len == 0 ? 0
                              : ZSTD_compress(frame->data() + hs, frame->size() - hs, scratch.data(), scratch.size(),
                                              spec.zstd_level);
    if (ZSTD_isError(z)) return absl::InternalError(absl::StrCat("zstd: ", ZSTD_getErrorName(z)));
    if (z > 0 && z < h.raw_len) {  // keep zstd only when it helps
      h.flags |= kFlagZstd;
      h.payload_len = z;
    } else {
      std::memcpy(frame->data() + hs, scratch.data(), h.raw_len);
    }
    frame->resize(hs + h.payload_len);
  }
  WriteHeader(h, frame->data());
  Put<uint32_t>(frame->data() + 48, FrameChecksum(frame->data(), hs, frame->data() + hs, h.payload_len));
  return absl::OkStatus();
}

absl::StatusOr<Header> ParseHeader(const uint8_t* data, size_t size, const DecodeLimits& limits) {
  if (data == nullptr || size < kHeaderBytes) return Corrupt(absl::StrCat("truncated header (", size, " bytes)"));
  if (std::memcmp(data, kMagic, 4) != 0) return Corrupt("not a Meridian frame (bad magic)");
  if (data[4] != kVersion) return Corrupt(absl::StrCat("unsupported frame version ", data[4]));
  Header h;
  if (data[5] > static_cast<uint8_t>(CodecKind::kInt2)) return Corrupt(absl::StrCat("unknown codec ", data[5]));
  h.kind = static_cast<CodecKind>(data[5]);
  h.dtype = static_cast<DType>(data[6]);
  if (core::DTypeSize(h.dtype) == 0) return Corrupt(absl::StrCat("unknown dtype ", data[6]));
  if (h.kind != CodecKind::kIdentity && !core::IsFloating(h.dtype)) return Corrupt("lossy codec on a non-float dtype");
  h.flags = data[7];
  if (h.flags & ~(kFlagZstd | kFlagTopkInt8 | kFlagBitmap)) return Corrupt("unknown flags");
  if (h.kind != CodecKind::kTopK && (h.flags & (kFlagTopkInt8 | kFlagBitmap)))
    return Corrupt("top-k flags on another codec");
  const int ndim = data[8];
  if (ndim > kMaxDims) return Corrupt(absl::StrCat(ndim, " dimensions (at most ", kMaxDims, ")"));
  if (data[9] || data[10] || data[11] || Get<uint32_t>(data + 52)) return Corrupt("reserved bytes are not zero");
  h.block = static_cast<int>(Get<uint32_t>(data + 12));
  if ((h.kind == CodecKind::kInt8 || h.kind == CodecKind::kInt4 || h.kind == CodecKind::kInt2 ||
       (h.flags & kFlagTopkInt8)) &&
      (h.block < 2 || h.block > 65536 || h.block % 2))
    return Corrupt(absl::StrCat("block size ", h.block));
  h.numel = Get<int64_t>(data + 16);
  h.count = Get<int64_t>(data + 24);
  h.payload_len = Get<uint64_t>(data + 32);
  h.raw_len = Get<uint64_t>(data + 40);
  if (size < HeaderSize(ndim)) return Corrupt("truncated shape");
  int64_t product = 1;
  for (int i = 0; i < ndim; ++i) {
    int64_t d = Get<int64_t>(data + kHeaderBytes + 8 * i);
    if (d < 0 || (d > 0 && product > limits.max_elements / d)) return Corrupt(absl::StrCat("absurd dimension ", d));
    product *= d;
    h.shape.push_back(d);
  }
  if (product != h.numel) return Corrupt(absl::StrCat("element count ", h.numel, " does not match the shape"));
  if (h.numel > limits.max_elements) return Corrupt(absl::StrCat(h.numel, " elements exceed the limit"));
  if (size != HeaderSize(ndim) + h.payload_len)
    return Corrupt(absl::StrCat("frame is ", size, " bytes but its header says ", HeaderSize(ndim) + h.payload_len));
  if (!(h.flags & kFlagZstd) && h.payload_len != h.raw_len) return Corrupt("payload lengths disagree");
  if (h.kind == CodecKind::kTopK) {
    if (h.count < 0 || h.count > h.numel || (h.numel > 0 && h.count == 0))
      return Corrupt(absl::StrCat("top-k count ", h.count, " for ", h.numel, " elements"));
    if (static_cast<double>(h.numel) > static_cast<double>(h.count) / kMinTopkFraction + 1)
      return Corrupt("top-k keeps too few elements for its size");
  } else if (h.count != 0) {
    return Corrupt("element count field set on a dense codec");
  }
  uint32_t want = Get<uint32_t>(data + 48);
  if (FrameChecksum(data, HeaderSize(ndim), data + HeaderSize(ndim), h.payload_len) != want)
    return Corrupt("checksum mismatch");
  return h;
}

}  // namespace

namespace {}  // namespace

absl::Status EncodeTo(const core::TensorView& in, const CodecSpec& spec, std::vector<uint8_t>* frame) {
  absl::Status st = spec.Check();
  if (!st.ok()) return st;
  if (spec.delta)
    return absl::InvalidArgumentError(
        absl::StrCat(spec.ToString(),
                     " encodes each sequence against its previous activation: use a DeltaEncoder "
                     "(compression/activation_delta.h)"));
  if (in.shape.size() > kMaxDims) return absl::InvalidArgumentError(absl::StrCat("at most ", kMaxDims, " dimensions"));
  for (int64_t d : in.shape)
    if (d < 0) return absl::InvalidArgumentError("negative dimension");
  const int64_t n = in.numel();
  if (n > 0 && in.data == nullptr) return absl::InvalidArgumentError("null data");
  if (core::DTypeSize(in.dtype) == 0) return absl::InvalidArgumentError("unknown dtype");
  if (spec.kind == CodecKind::kTopK && n > int64_t{0xffffffff})
    return absl::InvalidArgumentError("top-k supports at most 2^32 - 1 elements per tensor");
  if (spec.kind == CodecKind::kIdentity) return EncodeFloat(nullptr, in.shape, n, in.dtype, spec, in.data, frame);
  if (!core::IsFloating(in.dtype))
    return absl::InvalidArgumentError(
        absl::StrCat("codec ", spec.ToString(), " needs a float tensor, not ", core::DTypeName(in.dtype)));
  if (in.dtype == DType::kFloat32)
    return EncodeFloat(static_cast<const float*>(in.data), in.shape, n, in.dtype, spec, nullptr, frame);
  std::vector<float> tmp(static_cast<size_t>(n));
  core::ToFloat32(in.dtype, in.data, tmp.data(), tmp.size());
  return EncodeFloat(tmp.data(), in.shape, n, in.dtype, spec, nullptr, frame);
}

absl::StatusOr<std::vector<uint8_t>> Encode(const core::TensorView& in, const CodecSpec& spec) {
  std::vector<uint8_t> frame;
  absl::Status s = EncodeTo(in, spec, &frame);
  if (!s.ok()) return s;
  return frame;
}

int64_t MaxEncodedBytes(int64_t numel) {
  numel = std::max<int64_t>(numel, 0);
  return 4 * numel + numel / 4 + (int64_t{64} << 10);
}

absl::StatusOr<FrameInfo> InspectFrame(const uint8_t* data, size_t size) {
  auto h = ParseHeader(data, size, DecodeLimits{});
  if (!h.ok()) return h.status();
  FrameInfo info;
  info.spec.kind = h->kind;
  info.spec.block_size = h->block >= 2 ? h->block : 64;
  info.spec.zstd = h->flags & kFlagZstd;
  info.spec.topk_int8_values = h->flags & kFlagTopkInt8;
  if (h->kind == CodecKind::kTopK && h->numel > 0) info.spec.topk_fraction = static_cast<double>(h->count) / h->numel;
  info.dtype = h->dtype;
  info.shape = h->shape;
  info.frame_bytes = size;
  return info;
}

namespace {

// Decodes a validated frame into `out_bytes` (numel * dtype size bytes of the header's dtype).
absl::Status DecodePayload(const Header& h, const uint8_t* data, uint8_t* out_bytes) {
  const int64_t n = h.numel;
  const uint8_t* payload = data + HeaderSize(h.shape.size());
  // The raw payload's size follows from the header (top-k: up to its index bytes, checked below).
  uint64_t expected = 0;
  if (h.kind != CodecKind::kTopK) {
    expected = RawPayloadSize(h, 0);
    if (h.raw_len != expected)
      return Corrupt(absl::StrCat("payload is ", h.raw_len, " bytes, ", expected, " expected for ", n, " elements"));
  } else {
    // Smallest possible top-k payload: 8 + k one-byte varints + values; largest: 8 + bitmap/varints + values.
    uint64_t values = RawPayloadSize(h, 0) - 8;
    uint64_t max_index = std::max<uint64_t>(static_cast<uint64_t>((n + 7) / 8), 10 * static_cast<uint64_t>(h.count));
    if (h.raw_len < 8 + values || h.raw_len > 8 + values + max_index) return Corrupt("top-k payload size");
  }
  std::vector<uint8_t> unpacked;
  if (h.flags & kFlagZstd) {
    unsigned long long content = ZSTD_getFrameContentSize(payload, h.payload_len);
    if (content == ZSTD_CONTENTSIZE_ERROR || content == ZSTD_CONTENTSIZE_UNKNOWN || content != h.raw_len)
      return Corrupt("zstd payload size does not match the header");
    unpacked.resize(h.raw_len);
    size_t z = ZSTD_decompress(unpacked.data(), unpacked.size(), payload, h.payload_len);
    if (ZSTD_isError(z) || z != h.raw_len) return Corrupt("zstd payload does not decompress");
    payload = unpacked.data();
  }
  if (h.kind == CodecKind::kIdentity) {
    std::memcpy(out_bytes, payload, static_cast<size_t>(n) * core::DTypeSize(h.dtype));
    return absl::OkStatus();
  }
  std::vector<float> tmp;
  float* f;
  if (h.dtype == DType::kFloat32) {
    f = reinterpret_cast<float*>(out_bytes);
  } else {
    tmp.resize(static_cast<size_t>(n));
    f = tmp.data();
  }
  switch (h.kind) {
    case CodecKind::kFp16:
      core::ToFloat32(DType::kFloat16, payload, f, static_cast<size_t>(n));
      break;
    case CodecKind::kBf16:
      core::ToFloat32(DType::kBFloat16, payload, f, static_cast<size_t>(n));
      break;
    case CodecKind::kInt8:
      if (!ScalesValid(payload, Blocks(n, h.block))) return Corrupt("NaN, infinite, negative or oversized scale");
      DequantizeInt8(payload, n, h.block, f);
      break;
    case CodecKind::kInt4: {
      if (!ScalesValid(payload, Blocks(n, h.block))) return Corrupt("NaN, infinite, negative or oversized scale");
      const uint8_t* q = payload + 4 * Blocks(n, h.block);
      for (int64_t i = 0; i < (n + 1) / 2; ++i)
        if ((q[i] & 15) == 0 || (q[i] >> 4) == 0) return Corrupt("int4 code out of range");
      DequantizeInt4(payload, n, h.block, f);
      break;
    }
    case CodecKind::kInt2: {
      if (!ScalesValid(payload, Blocks(n, h.block))) return Corrupt("NaN, infinite, negative or oversized scale");
      const uint8_t* q = payload + 4 * Blocks(n, h.block);
      if (n % 4 && (q[n / 4] >> (2 * (n % 4)))) return Corrupt("int2 bits beyond the tensor");
      DequantizeInt2(payload, n, h.block, f);
      break;
    }
    case CodecKind::kTopK: {
      uint64_t index_bytes = Get<uint64_t>(payload);
      uint64_t values_bytes = RawPayloadSize(h, 0) - 8;
      if (index_bytes != h.raw_len - 8 - values_bytes) return Corrupt("top-k index section length");
      const uint8_t* q = payload + 8;
      const uint8_t* end = q + index_bytes;
      std::vector<uint32_t> idx;
      idx.reserve(static_cast<size_t>(h.count));
      if (h.flags & kFlagBitmap) {
        if (index_bytes != static_cast<uint64_t>((n + 7) / 8)) return Corrupt("top-k bitmap length");
        for (int64_t i = 0; i < n; ++i)
          if (q[i >> 3] >> (i & 7) & 1) {
            if (static_cast<int64_t>(idx.size()) == h.count) return Corrupt("top-k bitmap has too many bits");
            idx.push_back(static_cast<uint32_t>(i));
          }
        if (n % 8 && (q[n >> 3] >> (n % 8))) return Corrupt("top-k bitmap bits beyond the tensor");
      } else {
        uint64_t pos = 0;
        for (int64_t i = 0; i < h.count; ++i) {
          uint64_t gap = 0;
          int shift = 0;
          while (true) {
            if (q >= end) return Corrupt("truncated top-k index");
            if (shift > 35) return Corrupt("top-k index varint too long");
            uint8_t b = *q++;
            gap |= static_cast<uint64_t>(b & 127) << shift;
            shift += 7;
            if (!(b & 128)) break;
          }
          pos += gap + (i ? 1 : 0);
          if (pos >= static_cast<uint64_t>(n)) return Corrupt(absl::StrCat("top-k index ", pos, " out of range"));
          idx.push_back(static_cast<uint32_t>(pos));
        }
        if (q != end) return Corrupt("trailing bytes after top-k indices");
      }
      if (static_cast<int64_t>(idx.size()) != h.count) return Corrupt("top-k index count");
      std::fill(f, f + n, 0.0f);
      std::vector<float> vals(static_cast<size_t>(h.count));
      if (h.flags & kFlagTopkInt8) {
        if (!ScalesValid(end, Blocks(h.count, h.block))) return Corrupt("NaN, infinite, negative or oversized scale");
        DequantizeInt8(end, h.count, h.block, vals.data());
      } else {
        std::memcpy(vals.data(), end, 4 * vals.size());
        for (float v : vals)
          if (!std::isfinite(v)) return Corrupt("non-finite top-k value");
      }
      for (size_t i = 0; i < idx.size(); ++i) f[idx[i]] = vals[i];
      break;
    }
    case CodecKind::kIdentity:
      break;
  }
  if (h.dtype != DType::kFloat32) core::FromFloat32(h.dtype, f, out_bytes, static_cast<size_t>(n));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<core::Tensor> Decode(const uint8_t* data, size_t size, const DecodeLimits& limits) {
  auto h = ParseHeader(data, size, limits);
  if (!h.ok()) return h.status();
  core::Tensor out;
  out.dtype = h->dtype;
  out.shape = h->shape;
  out.bytes.resize(static_cast<size_t>(h->numel) * core::DTypeSize(h->dtype));
  absl::Status s = DecodePayload(*h, data, out.bytes.data());
  if (!s.ok()) return s;
  return out;
}

absl::Status DecodeInto(const uint8_t* data, size_t size, core::DType dtype, const std::vector<int64_t>& shape,
                        void* out) {
  int64_t expect = 1;
  for (int64_t d : shape) expect *= d;
  auto h = ParseHeader(data, size, DecodeLimits{});  // allocates nothing; the shape check follows
  if (!h.ok()) return h.status();
  if (h->dtype != dtype || h->shape != shape)
    return absl::InvalidArgumentError(absl::StrCat(
        "frame holds a ", core::DTypeName(h->dtype), " tensor of ", h->shape.size(), " dims and ", h->numel,
        " elements; expected ", core::DTypeName(dtype), " with ", shape.size(), " dims and ", expect, " elements"));
  return DecodePayload(*h, data, static_cast<uint8_t*>(out));
}

namespace {

// The payload bytes Encode writes for `numel` elements of `dtype` (exact but for top-k's varint indices,
// where it is the worst case of the two index encodings Encode chooses from, and zstd, left out).
uint64_t PayloadBytes(const CodecSpec& spec, DType dtype, int64_t numel) {
  Header h{spec.kind, dtype, 0, spec.block_size, {numel}, numel, 0, 0, 0};
  uint64_t index_bytes = 0;
  if (spec.kind == CodecKind::kTopK) {
    h.count = TopkCount(spec, numel);
    if (spec.topk_int8_values) h.flags |= kFlagTopkInt8;
    uint64_t gap = static_cast<uint64_t>(numel / std::max<int64_t>(h.count, 1));
    index_bytes = std::min<uint64_t>(static_cast<uint64_t>((numel + 7) / 8), h.count * VarintSize(gap));
  }
  return RawPayloadSize(h, index_bytes);
}

}  // namespace

double CompressionRatio(const CodecSpec& spec, DType dtype, int64_t numel) {
  if (numel <= 0) return 1.0;
  const double in_bytes = static_cast<double>(numel) * static_cast<double>(core::DTypeSize(dtype));
  return static_cast<double>(HeaderSize(1) + PayloadBytes(spec, dtype, numel)) / in_bytes;
}

double PayloadRatio(const CodecSpec& spec, DType dtype) {
  // A whole number of blocks, large enough that top-k's counts round as they would on a real tensor.
  const int64_t numel = static_cast<int64_t>(std::max(spec.block_size, 1)) * 65536;
  return static_cast<double>(PayloadBytes(spec, dtype, numel)) /
         (static_cast<double>(numel) * static_cast<double>(core::DTypeSize(dtype)));
}

absl::StatusOr<std::vector<uint8_t>> ErrorFeedback::Encode(const core::TensorView& input) {
  if (!core::IsFloating(input.dtype)) return absl::InvalidArgumentError("error feedback needs a float tensor");
  const int64_t n = input.numel();
  if (shape_.empty() && residual_.empty()) {
    shape_ = input.shape;
    residual_.assign(static_cast<size_t>(n), 0.0f);
  } else if (input.shape != shape_) {
    return absl::InvalidArgumentError("error feedback stream changed shape; Reset() it first");
  }
  std::vector<float> corrected(static_cast<size_t>(n));
  core::ToFloat32(input.dtype, input.data, corrected.data(), corrected.size());
  for (int64_t i = 0; i < n; ++i) corrected[i] += decay_ * residual_[i];
  // The frame declares the caller's dtype; the residual is kept in float32.
  std::vector<uint8_t> frame;
  absl::Status s = EncodeFloat(corrected.data(), input.shape, n, input.dtype, spec_, nullptr, &frame);
  if (!s.ok()) return s;
  auto decoded = Decode(frame.data(), frame.size());
  if (!decoded.ok()) return decoded.status();
  std::vector<float> back(static_cast<size_t>(n));
  core::ToFloat32(decoded->dtype, decoded->bytes.data(), back.data(), back.size());
  for (int64_t i = 0; i < n; ++i) residual_[i] = corrected[i] - back[i];
  return frame;
}

absl::Status ErrorFeedback::Restore(std::vector<int64_t> shape, std::vector<float> residual) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError("error feedback residual: negative dimension");
    n *= d;
  }
  if (static_cast<int64_t>(residual.size()) != n)
    return absl::InvalidArgumentError(
        absl::StrCat("error feedback residual: ", residual.size(), " values for a shape of ", n, " elements"));
  shape_ = std::move(shape);
  residual_ = std::move(residual);
  return absl::OkStatus();
}

}  // namespace meridian::compression
