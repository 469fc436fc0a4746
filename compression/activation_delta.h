// AQ-SGD activation compression (Wang et al., "Fine-tuning Language Models over Slow Networks using
// Activation Compression with Guarantees", NeurIPS 2022) for a pipeline link. Fine-tuning revisits its
// training sequences every epoch, and a sequence's activation at a cut changes little between visits.
// So the sender keeps, per sequence, the activation the receiver reconstructed last time, and sends only
// the quantised change (int4 or int2); a sequence seen for the first time goes as int8. Sender and
// receiver apply the same arithmetic to the same bytes, so their reconstructions stay equal bit for bit.
//
// A message is one identity frame (codec.h, so the transport checks its CRC like any other) whose
// payload is, little-endian (docs/compression.md):
//   "MRAD" | u8 version (1) | 3 zero bytes | u32 rows | u64 row_elements
//   rows x { i64 sequence id | u8 mode | 3 zero bytes | u32 base_version | u64 inner_bytes | inner frame }
// mode 0: first visit, the row quantised (int8), stored as version 1; mode 1: the row's change against
// the stored version base_version, stored as base_version + 1; mode 2: the row quantised (int8) and not
// stored (the store is full). A receiver whose stored version differs from base_version -- it missed a
// message, or restarted -- fails naming the sequence, never silently.
//
// Pure: links core and the codecs only. Thread-compatible: one encoder per outgoing link and one decoder
// per incoming link, each used by one thread at a time.
#ifndef MERIDIAN_COMPRESSION_ACTIVATION_DELTA_H_
#define MERIDIAN_COMPRESSION_ACTIVATION_DELTA_H_

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "compression/codec.h"
#include "core/tensor_view.h"

namespace meridian::compression {

// The codec of the gradients sent back over a link whose activations use `activation_codec`: the same,
// except behind AQ-SGD's deltas, which are for activations only: int8 behind int8-delta, int4 behind
// int4-delta and int2-delta (`activation_codec` as CodecSpec::Parse takes it).
std::string GradientCodecBehind(const std::string& activation_codec);

// The reconstructions of one link, by sequence id, all rows of one size: in memory up to
// `memory_bytes`, then in a spill file up to `spill_bytes` more. A row, once placed, stays where it is.
class ActivationStore {
 public:
  struct Options {
    int64_t memory_bytes = int64_t{2} << 30;
    int64_t spill_bytes = 0;  // 0: no spill file
    std::string spill_path;   // created (truncated) on the first spilled row, removed by the destructor
  };
  ActivationStore(Options options, int64_t row_elements);
  ~ActivationStore();
  ActivationStore(const ActivationStore&) = delete;
  ActivationStore& operator=(const ActivationStore&) = delete;

  // The stored version of `id`'s row, 0 when it has none.
  uint32_t Version(int64_t id) const;
  // Copies `id`'s row (row_elements floats). REQUIRES: Version(id) > 0.
  absl::Status Read(int64_t id, float* out) const;
  // Stores `row` as `id`'s reconstruction at `version` (> 0). Returns false, storing nothing, when `id`
  // is new and neither memory nor the spill file has room for another row. Errors: the spill file's I/O.
  absl::StatusOr<bool> Write(int64_t id, uint32_t version, const float* row);

  int64_t row_elements() const { return row_elements_; }
  int64_t memory_rows() const { return static_cast<int64_t>(memory_.size()); }
  int64_t spilled_rows() const { return spilled_; }

 private:
  struct Slot {
    bool in_memory;
    int64_t index;  // into memory_, or the row's position in the spill file
    uint32_t version;
  };
  Options o_;
  int64_t row_elements_;
  std::unordered_map<int64_t, Slot> slots_;
  std::vector<std::vector<float>> memory_;
  int64_t spilled_ = 0;
  int fd_ = -1;
};

// What a DeltaEncoder sent, by row, since it was made.
struct DeltaStats {
  int64_t fresh_rows = 0, delta_rows = 0, direct_rows = 0;
};

// The sending side of one link. `spec` is a delta codec (int4-delta, int2-delta, or int8-delta); first
// visits and rows that find the store full go as int8 with `spec`'s block size.
class DeltaEncoder {
 public:
  DeltaEncoder(CodecSpec spec, ActivationStore::Options store);
  // Encodes `x`, a float32 tensor whose first dimension has one row per sequence of `ids` (no sequence
  // twice). The shape (beyond the first dimension) must stay the same from call to call. The stored
  // reconstructions change only once every row is encoded, so a failed call leaves them as they were.
  // Errors: InvalidArgument for a bad input (dtype, shape, ids, non-finite values), or the store's I/O.
  absl::StatusOr<std::vector<uint8_t>> Encode(const core::TensorView& x, const std::vector<int64_t>& ids);
  // True once a row went as mode 2 (the store was full): the caller says so once.
  bool fell_back() const { return stats_.direct_rows > 0; }
  const DeltaStats& stats() const { return stats_; }
  // The receiver's reconstruction of `id` as this encoder last sent it (tests compare it with a decoder's).
  absl::Status Reconstruction(int64_t id, std::vector<float>* out) const;
  const ActivationStore* store() const { return store_.get(); }

 private:
  CodecSpec delta_, first_;
  ActivationStore::Options store_options_;
  std::unique_ptr<ActivationStore> store_;
  DeltaStats stats_;
};

// The receiving side of one link.
class DeltaDecoder {
 public:
  explicit DeltaDecoder(ActivationStore::Options store);
  // Decodes a DeltaEncoder's message into `out` (a float32 tensor of `shape`, whose first dimension is
  // ids.size()), checking that it carries exactly `ids` in order. The message is checked against the
  // expected shape before anything is allocated for it. Errors: DataLoss for a malformed message, or a
  // delta whose base this decoder does not hold at that version (naming the sequence); InvalidArgument
  // when the message's sequences, row size or length are not the expected ones; ResourceExhausted when
  // the sender stored a sequence this decoder's store has no room for; Internal for the spill file's I/O.
  absl::Status DecodeInto(const uint8_t* frame, size_t size, const std::vector<int64_t>& ids,
                          const std::vector<int64_t>& shape, float* out);
  const ActivationStore* store() const { return store_.get(); }

 private:
  ActivationStore::Options store_options_;
  std::unique_ptr<ActivationStore> store_;
};

}  // namespace meridian::compression

#endif  // MERIDIAN_COMPRESSION_ACTIVATION_DELTA_H_
