#!/usr/bin/env bash
# Sets everything up (Debian packages, build) and runs every test: the README's test command.
# Usage: bash scripts/test.sh [ctest arguments, e.g. -L unit]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
cd "${MERIDIAN_BUILD_DIR:-build}"
ctest --output-on-failure -j "${MERIDIAN_JOBS:-$(nproc)}" "$@"
