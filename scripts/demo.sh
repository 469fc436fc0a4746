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

step "3. Plan LLaMA-7B over Frankfurt, Virginia, Oregon and Singapore (the partitioner alone)"
$M plan --graph examples/graphs/llama-7b.json --profile examples/profiles/geo.json --micro-batches 32 \
  --dot "$RUN/plan-geo.dot" | tee "$RUN/plan-geo.txt"

step "4. Train across three emulated sites: measure, plan, run (scripts/demo.py)"
/usr/bin/python3 scripts/demo.py --build build --run runs/demo "$@"
