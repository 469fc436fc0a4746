// libFuzzer target for the frame decoder: any bytes must decode or fail with a Status, within the
// memory the frame justifies. Run by scripts/fuzz.sh.
#include <cstddef>
#include <cstdint>

#include "compression/codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  meridian::compression::DecodeLimits limits;
  limits.max_elements = 1 << 22;
  auto t = meridian::compression::Decode(data, size, limits);
  if (t.ok() && t->bytes.size() != static_cast<size_t>(t->numel()) * meridian::core::DTypeSize(t->dtype))
    __builtin_trap();
  (void)meridian::compression::InspectFrame(data, size);
  return 0;
}
