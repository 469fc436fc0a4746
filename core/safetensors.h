// Reading and writing the safetensors format (https://huggingface.co/docs/safetensors): an 8-byte
// little-endian header length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}, ...,
// "__metadata__": {string: string}}, then the tensor bytes. Pure (no torch); thread-safe.
#ifndef MERIDIAN_CORE_SAFETENSORS_H_
#define MERIDIAN_CORE_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/tensor_view.h"

namespace meridian::core {

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;  // by name
  std::map<std::string, std::string> metadata;
};

// Limits that bound a reader's work on hostile files.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100 << 20;  // 100 MiB

// Parses a whole file held in memory. Errors (InvalidArgument / DataLoss, naming `path` and the tensor):
// truncated file, header length beyond the file or the limit, malformed JSON, unknown dtype, shape and
// byte-range disagreement, out-of-range or overlapping offsets, bytes not covered by any tensor.
absl::StatusOr<SafetensorsFile> ParseSafetensors(const std::string& bytes, const std::string& path);
absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path);

// Serialises; tensors are laid out in name order. WriteSafetensors writes atomically (temporary file,
// fsync, rename).
std::string SerializeSafetensors(const SafetensorsFile& file);
absl::Status WriteSafetensors(const std::string& path, const SafetensorsFile& file);

// safetensors dtype names ("F32", "F16", "BF16", "I64", ...).
const char* SafetensorsDType(DType t);

}  // namespace meridian::core

#endif  // MERIDIAN_CORE_SAFETENSORS_H_
