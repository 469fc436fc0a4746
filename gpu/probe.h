// Device measurements that go around libtorch: dense GEMM throughput through cuBLAS directly, and the
// device's memory, for the executor's profile on CUDA builds (docs/executor.md). Torch-free and
// CUDA-free in this header; built with CUDA when nvcc and the toolkit are found (CMake option
// MERIDIAN_WITH_CUDA), otherwise every call says the build has no CUDA. Thread-compatible.
#ifndef MERIDIAN_GPU_PROBE_H_
#define MERIDIAN_GPU_PROBE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace meridian::gpu {

// True when this build has CUDA and at least one device is visible.
bool Available();

struct GemmMeasurement {
  std::string device_name;
  int n = 0;                         // n x n x n products
  double fp32_flops_per_second = 0;  // cublasSgemm-equivalent (cublasGemmEx, FP32 compute, no TF32)
  double tf32_flops_per_second = 0;  // FP32 data, TF32 tensor-core compute (0 below compute capability 8.0)
  double bf16_flops_per_second = 0;  // BF16 data, FP32 accumulation (0 below compute capability 8.0)
  double free_memory_bytes = 0, total_memory_bytes = 0;  // cudaMemGetInfo on that device
};

// Times `repeats` GEMMs of each kind on CUDA device `device` (median kept) after checking that cuBLAS
// computes a small product correctly (CheckCublasGemm). Errors: FailedPrecondition when the build has no
// CUDA or the device does not exist (naming it); Internal for a CUDA/cuBLAS failure, naming the call.
absl::StatusOr<GemmMeasurement> MeasureCublasGemm(int device, int n = 4096, int repeats = 10);

// Multiplies two seeded n x n FP32 matrices with cuBLAS on `device` and compares with a CPU product in
// double precision: InternalError naming the worst element when the relative error exceeds 1e-4.
absl::Status CheckCublasGemm(int device, int n = 96);

}  // namespace meridian::gpu

#endif  // MERIDIAN_GPU_PROBE_H_
