#!/usr/bin/env bash
# `dflow run --cpu-binding auto` (tasks sharing a host bound to their share of its CPUs, the
# default) against `--cpu-binding none` (every task free on every CPU, as before), one process
# per task, the two alternating in each round. Prints per round and layout the median step
# (`step time: median X µs`) and the mean step (`trained N steps in T s`, T/N) of each, and
# their ratios none / auto (above 1: binding is faster).
#
#   bash tests/planner/cpu_binding.sh [ROUNDS]
#
# Needs a release build (cargo build --release -p dflow). Quote the ranges of the ratios, not
# one round: step times depend on the machine's load (printed before and after).
set -euo pipefail
cd "$(dirname "$0")/../.."
DFLOW=${DFLOW:-target/release/dflow}
ROUNDS=${1:-3}
[ -x "$DFLOW" ] || { echo "build first: cargo build --release -p dflow" >&2; exit 1; }
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg); $(nproc) CPUs" >&2

GPT_SMALL=(tests/planner/gpt-2x32.json --data examples/data/shakespeare.txt.gz --batch-size 4 --steps 1000 --eval-every 0 --eval-batches 1 --quiet)
GPT=(examples/gpt/gpt.json --data examples/data/shakespeare.txt.gz --batch-size 12 --steps 20 --eval-every 0 --eval-batches 1 --quiet)

source tests/planner/jobs.sh

# run BINDING WORKERS ARGS...: `MEDIAN MEAN` µs of one run, every task under --cpu-binding BINDING.
run() {
  local binding=$1 workers=$2
  shift 2
  run_job "$workers" "--cpu-binding $binding" "$@"
}

echo "| round | layout | auto: median / mean | none: median / mean | none / auto, median | none / auto, mean |"
echo "|---|---|---|---|---|---|"
for r in $(seq "$ROUNDS"); do
  while IFS='|' read -r name workers args; do
    read -r -a a <<< "$args"
    read -r am amean <<< "$(run auto "$workers" "${a[@]}")"
    read -r nm nmean <<< "$(run none "$workers" "${a[@]}")"
    python3 - "$r" "$name" "$am" "$amean" "$nm" "$nmean" <<'PY'
import sys
r, name, am, amean, nm, nmean = sys.argv[1], sys.argv[2], *map(float, sys.argv[3:])
print(f"| {r} | {name} | {am:,.0f} / {amean:,.0f} µs | {nm:,.0f} / {nmean:,.0f} µs | {nm / am:.2f} | {nmean / amean:.2f} |")
PY
  done <<EOF2
GPT 2×32 dp=2|2|${GPT_SMALL[*]} --strategy allreduce
GPT 2×32 dp=2×pp=2 m=2 (4 tasks)|4|${GPT_SMALL[*]} --mesh dp=2,pp=2 --micro-batches 2
GPT 2×32 dp=2×tp=2×pp=2 m=2 (8 tasks)|8|${GPT_SMALL[*]} --mesh dp=2,tp=2,pp=2 --micro-batches 2
bundled GPT dp=2|2|${GPT[*]} --strategy allreduce
EOF2
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
