// meridian-gpu-probe [DEVICE [N]]: measures CUDA device DEVICE (default 0) through cuBLAS directly and
// prints one JSON object; exit 1 with the reason when it cannot (no CUDA in this build, no device).
#include <cstdio>
#include <cstdlib>

#include "gpu/probe.h"

int main(int argc, char** argv) {
  const int device = argc > 1 ? std::atoi(argv[1]) : 0;
  const int n = argc > 2 ? std::atoi(argv[2]) : 4096;
  if (n < 64 || n > 32768) {
    std::fprintf(stderr, "meridian-gpu-probe: N must be in [64, 32768], got %s\n", argv[2]);
    return 2;
  }
  auto m = meridian::gpu::MeasureCublasGemm(device, n);
  if (!m.ok()) {
    std::fprintf(stderr, "meridian-gpu-probe: %s\n", std::string(m.status().message()).c_str());
    return 1;
  }
  std::printf(
      "{\"device\": \"%s\", \"n\": %d, \"cublas_fp32_flops_per_second\": %.6g, \"cublas_tf32_flops_per_second\": "
      "%.6g, \"cublas_bf16_flops_per_second\": %.6g, \"free_memory_bytes\": %.6g, \"total_memory_bytes\": %.6g}\n",
      m->device_name.c_str(), m->n, m->fp32_flops_per_second, m->tf32_flops_per_second, m->bf16_flops_per_second,
      m->free_memory_bytes, m->total_memory_bytes);
  return 0;
}
