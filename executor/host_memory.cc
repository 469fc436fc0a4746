#include "executor/host_memory.h"

#include <malloc.h>

#include <spdlog/spdlog.h>

namespace meridian::executor {

void KeepFreedHostMemoryForReuse() {
  // Setting either threshold turns off glibc's adaptation of both, so both are set.
  constexpr int kMmapThreshold = 32 << 20;  // glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
  constexpr int kTrimThreshold = 256 << 20;
  if (mallopt(M_MMAP_THRESHOLD, kMmapThreshold) != 1 || mallopt(M_TRIM_THRESHOLD, kTrimThreshold) != 1)
    spdlog::warn("malloc refused its thresholds: tensors' memory is mapped afresh each step (slower on a CPU)");
}

}  // namespace meridian::executor
