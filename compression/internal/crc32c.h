// CRC-32C (Castagnoli) for frame checksums: SSE4.2 instructions when the CPU has them, a table otherwise.
// Thread-safe.
#ifndef MERIDIAN_COMPRESSION_INTERNAL_CRC32C_H_
#define MERIDIAN_COMPRESSION_INTERNAL_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace meridian::compression::internal {

// Extends `crc` (0 to start) over n bytes.
uint32_t Crc32c(uint32_t crc, const uint8_t* data, size_t n);

}  // namespace meridian::compression::internal

#endif  // MERIDIAN_COMPRESSION_INTERNAL_CRC32C_H_
