#!/usr/bin/env bash
# Every benchmark, one entry point: builds, then runs bench/run_all.py, which rewrites bench/RESULTS.md
# and bench/e2e.svg. Run as root (network namespaces, tc, cgroup CPU quotas); about 25 minutes.
# Usage: bash bench/run.sh [bench/run_all.py options, e.g. --tiny for a quick smoke test]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh >/dev/null
exec /usr/bin/python3 bench/run_all.py "$@"
