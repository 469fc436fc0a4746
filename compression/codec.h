// Codecs for activations and gradients on the wire: identity, fp16/bf16 casts, int8/int4 blockwise
// absmax quantisation, top-k sparsification (optionally with int8 values), each optionally followed
// by zstd. Every encoded tensor is a self-describing, versioned, checksummed frame (docs/compression.md).
//
// Pure: links core only. All functions are thread-safe; ErrorFeedback is thread-compatible.
#ifndef MERIDIAN_COMPRESSION_CODEC_H_
#define MERIDIAN_COMPRESSION_CODEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/codec_spec.h"
#include "core/tensor_view.h"

namespace meridian::compression {

// The codec names and options (core/codec_spec.h): CodecSpec::Parse reads "int8", "int4:block=32+zstd",
// "topk:k=0.001", "int2-delta", ...
using core::CodecKind;
using core::CodecSpec;

// Encodes a float32/float16/bfloat16 tensor (identity also accepts any dtype) into a frame.
// Errors: InvalidArgument for an unsupported dtype, a bad spec, or non-finite values in a quantised
// tensor (a NaN would poison a whole block's scale).
absl::StatusOr<std::vector<uint8_t>> Encode(const core::TensorView& input, const CodecSpec& spec);

// As Encode, into `frame` (resized; its capacity is reused across calls, so a stream allocates once).
absl::Status EncodeTo(const core::TensorView& input, const CodecSpec& spec, std::vector<uint8_t>* frame);

// Bounds on what a decoder accepts (the receiver knows what to expect).
struct DecodeLimits {
  int64_t max_elements = int64_t{1} << 30;
};

// Decodes a frame into a tensor of the original dtype and shape. Any invalid frame -- truncated,
// wrong length, bad magic or version, out-of-range or unsorted indices, NaN/Inf scales, absurd shapes,
// checksum mismatch -- returns DataLoss or InvalidArgument; the decoder allocates at most what the
// frame's own length justifies (dense outputs of lossy frames are bounded by `limits`).
absl::StatusOr<core::Tensor> Decode(const uint8_t* data, size_t size, const DecodeLimits& limits = {});

// Decodes into caller memory `out` (numel * DTypeSize(dtype) bytes) after checking that the frame holds
// exactly a `dtype` tensor of `shape`; errors as Decode, or InvalidArgument on a dtype/shape mismatch
// naming both. Allocates nothing for dense codecs without zstd.
absl::Status DecodeInto(const uint8_t* data, size_t size, core::DType dtype, const std::vector<int64_t>& shape,
                        void* out);

// An upper bound on the frame -- or AQ-SGD delta message (activation_delta.h) -- that any codec makes of a
// float32 tensor of `numel` elements: identity's 4 bytes an element, plus room for top-k's bitmap, block
// scales, zstd's worst case and headers. A receiver checks a frame's claimed size against it before
// buffering, so a peer cannot make it hold more than its tensors justify.
int64_t MaxEncodedBytes(int64_t numel);

// Header facts of a frame without decoding it (validated as in Decode).
struct FrameInfo {
  CodecSpec spec;
  core::DType dtype;
  std::vector<int64_t> shape;
  size_t frame_bytes;
};
absl::StatusOr<FrameInfo> InspectFrame(const uint8_t* data, size_t size);

// The frame size Encode produces for `numel` elements of `dtype` (exact for every codec but top-k's
// varint indices and zstd, for which it is the worst case without zstd), divided by the input bytes.
double CompressionRatio(const CodecSpec& spec, core::DType dtype, int64_t numel);
// The same for a large tensor, without the frame's header: the payload's bytes per input byte (int8 on
// float32 with blocks of 64: exactly (64 + 4) / 256). What a cost model prices a codec at.
double PayloadRatio(const CodecSpec& spec, core::DType dtype);

// Error feedback for one stream of same-shaped tensors: what the lossy codec dropped from tensor t
// is added to tensor t+1 before encoding, so nothing is lost over time (EF-SGD, DTFM/AQ-SGD).
// With `decay` beta < 1 the kept residual is scaled by beta before it is added: e = beta e + x is
// encoded, and e minus what was sent is kept. That is SparseLoCo's accumulator (Sarfi et al. 2025), which
// stands in for DiLoCo's outer momentum; beta = 1 (the default) is plain error feedback.
// Thread-compatible: one instance per stream, used by one thread at a time.
class ErrorFeedback {
 public:
  explicit ErrorFeedback(CodecSpec spec, float decay = 1.0f) : spec_(spec), decay_(decay) {}
  // Encodes input + decay x residual and keeps the new residual. Errors as Encode, and InvalidArgument
  // when the shape changes within the stream (call Reset first).
  absl::StatusOr<std::vector<uint8_t>> Encode(const core::TensorView& input);
  void Reset() {
    residual_.clear();
    shape_.clear();
  }
  const std::vector<float>& residual() const { return residual_; }
  // The shape of the stream's tensors; empty before the first Encode (and after Reset).
  const std::vector<int64_t>& shape() const { return shape_; }
  // Replaces the residual (a checkpoint's, as residual() and shape() gave it) for a stream of tensors of
  // `shape`; InvalidArgument, and nothing changed, when `residual` does not hold the shape's element count.
  absl::Status Restore(std::vector<int64_t> shape, std::vector<float> residual);

 private:
  CodecSpec spec_;
  float decay_;
  std::vector<int64_t> shape_;
  std::vector<float> residual_;
};

}  // namespace meridian::compression

#endif  // MERIDIAN_COMPRESSION_CODEC_H_
