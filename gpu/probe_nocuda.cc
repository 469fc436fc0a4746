// The probe in a build without CUDA (no nvcc or toolkit at configure time): every call says so.
#include "gpu/probe.h"

namespace meridian::gpu {

bool Available() { return false; }

absl::StatusOr<GemmMeasurement> MeasureCublasGemm(int device, int, int) {
  return absl::FailedPreconditionError(
      "this build has no CUDA (configured without nvcc/CUDA toolkit): cannot "
      "measure cuda:" +
      std::to_string(device) + " through cuBLAS");
}

absl::Status CheckCublasGemm(int device, int) { return MeasureCublasGemm(device).status(); }

}  // namespace meridian::gpu
