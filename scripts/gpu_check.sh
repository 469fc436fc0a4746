#!/usr/bin/env bash
# Builds and runs the compression library's GPU tests and kernel benchmarks, and the cuBLAS probe
# (gpu/: GEMM throughput through cuBLAS directly, with a correctness check) and NCCL among a site's
# workers (gpu/nccl_group.h, two ranks on two GPUs where present) on a GPU machine, in one call (a few
# minutes). The GPU machine need not have Debian's -dev packages: run `--prepare` here
# first, which downloads the few it needs into .gpudeps/ (ignored by git), and carry that folder.
#   here:        bash scripts/gpu_check.sh --prepare
#   GPU machine: bash scripts/gpu_check.sh            (writes gpu-check.log; copies it to $OUT if set)
set -euo pipefail
cd "$(dirname "$0")/.."
DEPS=(libabsl-dev libabsl20220623 libzstd-dev libgtest-dev libgmock-dev)
if [[ ${1:-} == --prepare ]]; then
  mkdir -p .gpudeps && grep -qx '/.gpudeps/' .git/info/exclude 2>/dev/null || echo '/.gpudeps/' >> .git/info/exclude
  (cd .gpudeps && apt-get download "${DEPS[@]}")
  ls -la .gpudeps
  exit 0
fi
PREFIX=/tmp/meridian-gpudeps
mkdir -p "$PREFIX"
for deb in .gpudeps/*.deb; do dpkg -x "$deb" "$PREFIX"; done
export LD_LIBRARY_PATH="$PREFIX/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
LOG=gpu-check.log
{
  nvidia-smi --query-gpu=name,memory.total --format=csv || true
  cmake -S . -B build-gpu -G Ninja -DMERIDIAN_COMPRESSION_ONLY=ON -DMERIDIAN_BUILD_BENCH=OFF \
    -DCMAKE_PREFIX_PATH="$PREFIX/usr;$PREFIX/usr/lib/x86_64-linux-gnu/cmake" -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_BUILD_TYPE=Release
  cmake --build build-gpu -j "$(nproc)"
  build-gpu/compression/cuda/compression_gpu_test
  build-gpu/compression/compression_test --gtest_brief=1
  build-gpu/compression/cuda/compression_gpu_bench
  build-gpu/gpu/gpu_probe_test
  # NCCL among a site's workers, one rank per device: needs two GPUs (it says so and skips on one).
  # Bounded: a collective that never completes would otherwise hold the machine.
  if [[ -x build-gpu/gpu/nccl_group_test ]]; then timeout 300 build-gpu/gpu/nccl_group_test; else
    echo "NCCL is not in this CUDA toolkit: gpu/nccl_group_test was not built"; fi
  build-gpu/bin/meridian-gpu-probe 0 8192
} 2>&1 | tee "$LOG"
[[ -n ${OUT:-} ]] && cp "$LOG" "$OUT/" || true
