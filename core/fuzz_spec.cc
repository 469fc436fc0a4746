// libFuzzer target for the spec loader: any byte string must yield a spec or diagnostics, never a crash.
// Built with -DMERIDIAN_FUZZ=ON and clang; run by scripts/fuzz.sh.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/cluster_spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  auto r = meridian::core::ParseSpec(text, "fuzz.yaml");
  if (!r.spec && r.errors.empty()) __builtin_trap();  // the loader must always explain a rejection
  return 0;
}
