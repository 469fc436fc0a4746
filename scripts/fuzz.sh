#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) in build-fuzz/ and runs each for a bounded time.
# Not part of CI. Usage: scripts/fuzz.sh [seconds per target, default 60]
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-60}
command -v clang++ >/dev/null || { echo "fuzz.sh: clang++ is needed (apt-get install clang libclang-rt-14-dev)"; exit 2; }
cmake -S . -B build-fuzz -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DMERIDIAN_FUZZ=ON \
  -DMERIDIAN_BUILD_TESTS=OFF -DMERIDIAN_BUILD_BENCH=OFF -DMERIDIAN_WITH_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
targets=(spec_fuzzer)
[[ -f compression/fuzz_frame.cc ]] && targets+=(frame_fuzzer)
cmake --build build-fuzz --target "${targets[@]}"
mkdir -p build-fuzz/corpus
for t in "${targets[@]}"; do
  mkdir -p "build-fuzz/corpus/$t"
  [[ $t == spec_fuzzer ]] && cp examples/clusters/*.yaml "build-fuzz/corpus/$t/" 2>/dev/null || true
  echo "== $t for ${SECS}s"
  "build-fuzz/$(find build-fuzz -name "$t" -type f -printf '%P\n' | head -1)" -max_total_time="$SECS" \
    -rss_limit_mb=2048 -timeout=10 "build-fuzz/corpus/$t"
done
