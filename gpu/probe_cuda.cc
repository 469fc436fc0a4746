#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gpu/probe.h"

namespace meridian::gpu {
namespace {

absl::Status Cuda(cudaError_t e, const char* call) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(call, ": ", cudaGetErrorString(e)));
}

absl::Status Blas(cublasStatus_t s, const char* call) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(call, ": cuBLAS status ", static_cast<int>(s)));
}

#define RETURN_IF_ERROR(expr) \
  do {                        \
    absl::Status _s = (expr); \
    if (!_s.ok()) return _s;  \
  } while (0)

// Device buffers and a handle, released on every path.
struct Session {
  cublasHandle_t handle = nullptr;
  std::vector<void*> buffers;
  ~Session() {
    for (void* b : buffers) cudaFree(b);
    if (handle) cublasDestroy(handle);
  }
  absl::StatusOr<void*> Alloc(size_t bytes) {
    void* p = nullptr;
    RETURN_IF_ERROR(Cuda(cudaMalloc(&p, bytes), "cudaMalloc"));
    buffers.push_back(p);
    return p;
  }
};

absl::Status Open(int device, Session* s) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
    return absl::FailedPreconditionError(absl::StrCat("no CUDA device is visible: cannot measure cuda:", device));
  if (device < 0 || device >= count)
    return absl::FailedPreconditionError(
        absl::StrCat("cuda:", device, " does not exist (", count, " CUDA device(s) visible)"));
  RETURN_IF_ERROR(Cuda(cudaSetDevice(device), "cudaSetDevice"));
  return Blas(cublasCreate(&s->handle), "cublasCreate");
}

// C = A B for column-major n x n matrices of `type` with compute type `compute`.
absl::Status Gemm(cublasHandle_t h, int n, const void* a, const void* b, void* c, cudaDataType type,
                  cublasComputeType_t compute) {
  const float one = 1, zero = 0;
  return Blas(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a, type, n, b, type, n, &zero, c,
                           type == CUDA_R_16BF ? CUDA_R_16BF : CUDA_R_32F, n, compute, CUBLAS_GEMM_DEFAULT),
              "cublasGemmEx");
}

}  // namespace

bool Available() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

absl::Status CheckCublasGemm(int device, int n) {
  Session s;
  RETURN_IF_ERROR(Open(device, &s));
  std::mt19937 rng(7);
  std::normal_distribution<float> g(0, 1);
  std::vector<float> a(n * n), b(n * n), c(n * n);
  for (auto& x : a) x = g(rng);
  for (auto& x : b) x = g(rng);
  const size_t bytes = sizeof(float) * n * n;
  auto da = s.Alloc(bytes), db = s.Alloc(bytes), dc = s.Alloc(bytes);
  for (const auto* r : {&da, &db, &dc}) RETURN_IF_ERROR(r->status());
  RETURN_IF_ERROR(Cuda(cudaMemcpy(*da, a.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy"));
  RETURN_IF_ERROR(Cuda(cudaMemcpy(*db, b.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy"));
  RETURN_IF_ERROR(Gemm(s.handle, n, *da, *db, *dc, CUDA_R_32F, CUBLAS_COMPUTE_32F));
  RETURN_IF_ERROR(Cuda(cudaMemcpy(c.data(), *dc, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy"));
  double worst = 0;
  int wi = 0, wj = 0;
  for (int j = 0; j < n; ++j)  // column-major: element (i, j) at i + j n
    for (int i = 0; i < n; ++i) {
      double want = 0, scale = 0;
      for (int k = 0; k < n; ++k) {
        want += static_cast<double>(a[i + k * n]) * b[k + j * n];
        scale += std::fabs(static_cast<double>(a[i + k * n]) * b[k + j * n]);
      }
      const double err = std::fabs(c[i + j * n] - want) / std::max(scale, 1e-30);
      if (err > worst) worst = err, wi = i, wj = j;
    }
  if (worst > 1e-4)
    return absl::InternalError(absl::StrCat("cuBLAS FP32 GEMM on cuda:", device, " is wrong: element (", wi, ", ", wj,
                                            ") off by ", worst, " of its magnitude"));
  return absl::OkStatus();
}

absl::StatusOr<GemmMeasurement> MeasureCublasGemm(int device, int n, int repeats) {
  if (n < 1 || n > 65536 || repeats < 1)
    return absl::InvalidArgumentError(
        absl::StrCat("cuBLAS probe: n must be in [1, 65536] and repeats >= 1 (got ", n, ", ", repeats, ")"));
  RETURN_IF_ERROR(CheckCublasGemm(device));
  Session s;
  RETURN_IF_ERROR(Open(device, &s));
  GemmMeasurement m;
  m.n = n;
  cudaDeviceProp prop;
  RETURN_IF_ERROR(Cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties"));
  m.device_name = prop.name;
  size_t free_bytes = 0, total_bytes = 0;
  RETURN_IF_ERROR(Cuda(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo"));
  m.free_memory_bytes = static_cast<double>(free_bytes);
  m.total_memory_bytes = static_cast<double>(total_bytes);
  const size_t bytes = sizeof(float) * static_cast<size_t>(n) * n;
  auto a = s.Alloc(bytes), b = s.Alloc(bytes), c = s.Alloc(bytes);
  for (const auto* r : {&a, &b, &c}) RETURN_IF_ERROR(r->status());
  // Inputs: any finite values do; 0.5 in both FP32 and BF16 (0x3F00).
  std::vector<float> half(static_cast<size_t>(n) * n, 0.5f);
  for (void* p : {*a, *b})
    RETURN_IF_ERROR(Cuda(cudaMemcpy(p, half.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy"));
  auto time = [&](cudaDataType type, cublasComputeType_t compute) -> absl::StatusOr<double> {
    RETURN_IF_ERROR(Gemm(s.handle, n, *a, *b, *c, type, compute));  // warm-up (and algorithm choice)
    RETURN_IF_ERROR(Cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
    std::vector<double> t;
    for (int i = 0; i < repeats; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      RETURN_IF_ERROR(Gemm(s.handle, n, *a, *b, *c, type, compute));
      RETURN_IF_ERROR(Cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
      t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
    return 2.0 * n * n * static_cast<double>(n) / t[t.size() / 2];
  };
  auto fp32 = time(CUDA_R_32F, CUBLAS_COMPUTE_32F);
  if (!fp32.ok()) return fp32.status();
  // TF32 and BF16 tensor cores exist from compute capability 8.0 (Ampere) on; older devices report 0.
  const bool tensor_cores = prop.major >= 8;
  absl::StatusOr<double> tf32 = 0.0;
  if (tensor_cores) tf32 = time(CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32);
  if (!tf32.ok()) return tf32.status();
  // BF16 inputs (0.5) in the first half of the same buffers; only throughput matters.
  absl::StatusOr<double> bf16 = 0.0;
  if (tensor_cores) {
    std::vector<uint16_t> bf(static_cast<size_t>(n) * n, 0x3F00);
    for (void* p : {*a, *b})
      RETURN_IF_ERROR(Cuda(cudaMemcpy(p, bf.data(), bf.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy"));
    bf16 = time(CUDA_R_16BF, CUBLAS_COMPUTE_32F);
  }
  if (!bf16.ok()) return bf16.status();
  m.fp32_flops_per_second = *fp32;
  m.tf32_flops_per_second = *tf32;
  m.bf16_flops_per_second = *bf16;
  return m;
}

}  // namespace meridian::gpu
