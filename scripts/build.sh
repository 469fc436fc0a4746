#!/usr/bin/env bash
# Configures and builds Meridian into build/ (Ninja, ccache when present). Incremental when re-run.
# Usage: scripts/build.sh [extra cmake -D options]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${MERIDIAN_BUILD_DIR:-build}
if [[ ! -f "$BUILD_DIR/build.ninja" ]]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@"
elif (($#)); then
  cmake -S . -B "$BUILD_DIR" "$@"
fi
cmake --build "$BUILD_DIR" -j "${MERIDIAN_JOBS:-$(nproc)}"
