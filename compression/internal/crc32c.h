// CRC-32C (Castagnoli) for frame checksums: SSE4.2 instructions when the CPU has them, a table otherwise.
// Thread-safe.
#ifndef MERIDIAN_COMPRESSION_INTERNAL_CRC32C_H_
#define MERIDIAN_COMPRESSION_INTERNAL_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace meridian::compression::internal {

// Extends `crc` (0 to start) over n bytes.
uint32_t Crc32c(uint32_t crc, const uint8_t* data, size_t n);

// A four-lane CRC-32C for large payloads: lane j runs CRC-32C over the 8-byte words j, j+4, j+8, ...
// (the trailing n % 8 bytes go to lane 0 after its words), and the result is the CRC-32C of the four
// lane values (little-endian) extending `crc`. Four independent streams run about 3x faster than one;
// every byte still feeds exactly one CRC, so any single-byte error is detected.
uint32_t Crc32cStriped(uint32_t crc, const uint8_t* data, size_t n);

}  // namespace meridian::compression::internal

#endif  // MERIDIAN_COMPRESSION_INTERNAL_CRC32C_H_
