#!/usr/bin/env bash
# Installs every build and test dependency of Meridian from Debian 12's registry.
# Idempotent: when everything is present it only checks (dpkg-query) and returns in about a second.
# Usage: scripts/setup.sh        (as root, or with sudo available)
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git clang-format
  libtorch-dev libopenblas0-pthread libgloo-dev
  libgrpc++-dev protobuf-compiler protobuf-compiler-grpc libprotobuf-dev
  libyaml-cpp-dev libssl-dev openssl
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev libspdlog-dev libfmt-dev nlohmann-json3-dev
  libsentencepiece-dev sentencepiece
  libzstd-dev libcpp-httplib-dev
  python3-grpcio python3-numpy python3-yaml python3-torch
  iproute2 iperf3 curl
  libjs-chart.js chromium openssh-server slurm-wlm
)

missing=()
for p in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "installed" ]] || missing+=("$p")
done

if ((${#missing[@]} == 0)); then
  echo "setup: all ${#PACKAGES[@]} packages present"
  exit 0
fi

echo "setup: installing ${#missing[@]} packages: ${missing[*]}"
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup: done"
