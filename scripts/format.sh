#!/usr/bin/env bash
# Applies .clang-format to every C++ and CUDA source git tracks or would add (untracked files not ignored:
# a new file is formatted before its first commit). clang-format from scripts/setup.sh.
# Usage: scripts/format.sh          rewrite in place
#        scripts/format.sh --check  list the files that differ; exit 1 if any
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files --cached --others --exclude-standard '*.cc' '*.h' '*.cu' '*.cuh')
if [[ "${1:-}" == "--check" ]]; then
  bad=()
  for f in "${files[@]}"; do
    clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
  done
  if ((${#bad[@]})); then
    printf 'not formatted (run scripts/format.sh): %s\n' "${bad[@]}"
    exit 1
  fi
  echo "format: ${#files[@]} files follow .clang-format"
  exit 0
fi
clang-format -i "${files[@]}"
