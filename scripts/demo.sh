#!/usr/bin/env bash
# The README's demo command: sets everything up, then runs what Meridian can do today on the bundled
# local cluster (3 emulated sites) and the geo example. Writes its results under runs/local/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh >/dev/null
M=build/bin/meridian
RUN=runs/local
mkdir -p "$RUN"

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "1. Validate the cluster specs"
$M validate examples/clusters/local.yaml examples/clusters/geo.yaml

step "2. Create the local cluster's CA and certificates ($RUN/certs)"
$M certs init --spec examples/clusters/local.yaml --out "$RUN/certs" --force
openssl verify -CAfile "$RUN/certs/ca.pem" "$RUN"/certs/{coordinator,fast,medium,slow}.pem

step "3. Plan the 34M-parameter LLaMA over the three local sites (1.0 / 0.6 / 0.4 of a core, 100 and 20 Mbit/s links)"
$M plan --graph examples/graphs/llama-34m.json --profile examples/profiles/local.json --micro-batches 6 \
  --dot "$RUN/plan-local.dot"

step "4. Plan LLaMA-7B over Frankfurt, Virginia, Oregon and Singapore"
$M plan --graph examples/graphs/llama-7b.json --profile examples/profiles/geo.json --micro-batches 32 \
  --dot "$RUN/plan-geo.dot" | tee "$RUN/plan-geo.txt"

if [[ -x build/bin/meridian-codec ]]; then
  step "5. Compress a 16 MiB activation tensor with each codec"
  build/bin/meridian-codec --size-mib 16
fi

step "Done"
echo "Plans (Graphviz) in $RUN/plan-local.dot and $RUN/plan-geo.dot; certificates in $RUN/certs."
