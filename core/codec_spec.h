// The name of a codec and its options, as specs, plans and frames spell it: what compression/ encodes
// with, kept here so that the cluster spec can check a job's codecs without linking the codecs.
//
// Pure data. Thread-safe (no shared state).
#ifndef MERIDIAN_CORE_CODEC_SPEC_H_
#define MERIDIAN_CORE_CODEC_SPEC_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace meridian::core {

// Values are part of the frame format (docs/compression.md): never renumber.
enum class CodecKind : uint8_t { kIdentity = 0, kFp16 = 1, kBf16 = 2, kInt8 = 3, kInt4 = 4, kTopK = 5, kInt2 = 6 };

// The smallest top-k fraction a spec may ask for; bounds the dense output a top-k frame may claim.
inline constexpr double kMinTopkFraction = 1e-5;

struct CodecSpec {
  CodecKind kind = CodecKind::kIdentity;
  int block_size = 64;          // int8/int4/int2 (and top-k int8 values): elements per absmax scale; even, 2..65536
  double topk_fraction = 0.01;  // top-k: fraction of elements kept, in [1e-5, 1]
  // top-k: > 0 keeps that fraction of each run of `topk_chunk` elements (the last run may be shorter)
  // instead of the whole tensor's largest: SparseLoCo's chunk-wise top-k, which spreads the kept values
  // over every part of a tensor. 0: the whole tensor's.
  int topk_chunk = 0;
  bool topk_int8_values = false;
  bool zstd = false;   // compress the payload with zstd afterwards
  int zstd_level = 1;  // -5..19
  // AQ-SGD activation deltas (int8, int4, int2 only): each training sequence's activation is sent as
  // the quantised change against its previous reconstruction (compression/activation_delta.h). Encode
  // refuses such a spec: the previous reconstruction lives in a DeltaEncoder.
  bool delta = false;

  // Parses "identity" (alias "none"), "fp16", "bf16", "int8", "int4", "int2", "topk", "topk-int8", and
  // the delta codecs "int8-delta", "int4-delta", "int2-delta", with options ":block=N", ":k=F",
  // ":level=L", ":chunk=N" (top-k) and a "+zstd" suffix, e.g. "int4:block=32+zstd", "topk:k=0.001",
  // "topk-int8:k=0.03:chunk=4096", "int2-delta".
  // Errors: InvalidArgument naming the unknown codec or option, or the value out of range.
  static absl::StatusOr<CodecSpec> Parse(const std::string& text);
  // OK when every field is in range (as above); else InvalidArgument naming the field.
  absl::Status Check() const;
  std::string ToString() const;  // every option spelled out, e.g. "int8:block=64"
  // The shortest text Parse reads back as this spec: options at their defaults left out ("int8",
  // "int4-delta", "topk:k=0.001"). How plans name codecs.
  std::string ShortString() const;
  bool lossless() const { return kind == CodecKind::kIdentity; }
};

}  // namespace meridian::core

#endif  // MERIDIAN_CORE_CODEC_SPEC_H_
