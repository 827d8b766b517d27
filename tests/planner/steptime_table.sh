#!/usr/bin/env bash
# Predicted (`dflow plan --layout`, "step as dflow runs it") against measured step time for
# every layout dflow runs on this machine: the job's `step time: median X µs` (the median
# interval between its steps: a steady step, as the planner predicts one and `dflow bench
# calibrate` fits), median of RUNS runs (range in brackets); beside it the mean step of the
# job's `trained N steps in T s` line (T/N: with the first step's warm-up and every stall a
# shared machine causes), median of the runs. Prints a Markdown table.
#
#   bash tests/planner/steptime_table.sh [PROFILE.json] [RUNS]
#
# PROFILE: a profile from `dflow bench calibrate --out PROFILE.json` (made here when missing).
# Needs a release build (cargo build --release -p dflow). Step times depend on the machine's
# load: the script prints the load average before and after; quote ranges, not best runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
DFLOW=${DFLOW:-target/release/dflow}
PROFILE=${1:-target/steptime-profile.json}
RUNS=${2:-3}
[ -x "$DFLOW" ] || { echo "build first: cargo build --release -p dflow" >&2; exit 1; }
if [ ! -f "$PROFILE" ]; then
  "$DFLOW" bench calibrate --out "$PROFILE" >&2
fi
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg); $(nproc) CPUs; profile $PROFILE" >&2

DIGITS=(--data examples/data/digits.csv.gz --epochs 20 --test-fraction 0 --quiet)
GPT_SMALL=(--data examples/data/shakespeare.txt.gz --batch-size 4 --steps 1000 --eval-every 0 --eval-batches 1 --quiet)
GPT=(--data examples/data/shakespeare.txt.gz --batch-size 12 --steps 20 --eval-every 0 --eval-batches 1 --quiet)

# predicted GRAPH DEVICES BATCH LAYOUT: the predicted step in µs.
predicted() {
  "$DFLOW" plan "$1" --devices "$2" --batch-size "$3" --profile "$PROFILE" --layout "$4" |
    awk '/step as dflow runs it:/ { v = $6; u = $7; gsub(/,/, "", v);
           if (u == "ms") v *= 1000; else if (u == "s") v *= 1e6; else if (u == "ns") v /= 1000; print v }'
}

source tests/planner/jobs.sh

# measure WORKERS GRAPH ARGS...: RUNS step times (`MEDIAN:MEAN` µs), one per line.
measure() {
  local workers=$1
  shift
  for _ in $(seq "$RUNS"); do
    run_job "$workers" "" "$@" | tr ' ' ':'
  done
}

# row NAME PREDICTED_µs MEDIAN:MEAN...: a table row.
row() {
  local name=$1 pred=$2; shift 2
  python3 - "$name" "$pred" "$@" <<'PY'
import sys, statistics
name, pred = sys.argv[1], float(sys.argv[2])
runs = [tuple(float(v) for v in x.split(":")) for x in sys.argv[3:]]
xs, means = [r[0] for r in runs], [r[1] for r in runs]
med, mean = statistics.median(xs), statistics.median(means)
print(f"| {name} | {pred:,.0f} µs | {med:,.0f} µs ({min(xs):,.0f}–{max(xs):,.0f}) | {(pred - med) / med * 100:+.1f}% "
      f"| {mean:,.0f} µs ({min(means):,.0f}–{max(means):,.0f}) | {(pred - mean) / mean * 100:+.1f}% |")
PY
}

echo "| layout | predicted | median step, median (range) of $RUNS runs | predicted − measured | mean step (T/N), median (range) | predicted − mean |"
echo "|---|---|---|---|---|---|"
D=examples/digits/digits.json
A=examples/digits/digits-adamw.json
S=tests/planner/gpt-2x32.json
G=examples/gpt/gpt.json
M=examples/gpt/gpt-moe.json
row "digits dp=2" "$(predicted $D 2 32 dp=2)" $(measure 2 $D --strategy allreduce "${DIGITS[@]}")
row "digits pp=2 m=4" "$(predicted $D 2 32 pp=2,m=4)" $(measure 2 $D --strategy pipeline --stages 2 --micro-batches 4 "${DIGITS[@]}")
for z in 1 2 3; do
  row "digits-adamw dp=2 zero=$z" "$(predicted $A 2 32 dp=2,zero=$z)" $(measure 2 $A --strategy zero --zero-stage $z "${DIGITS[@]}")
done
row "GPT 2×32 tp=2" "$(predicted $S 2 4 tp=2)" $(measure 2 $S --strategy tensor --tp 2 "${GPT_SMALL[@]}")
row "GPT 2×32 dp=2" "$(predicted $S 2 4 dp=2)" $(measure 2 $S --strategy allreduce "${GPT_SMALL[@]}")
row "GPT 2×32 dp=2×tp=2 (4 tasks)" "$(predicted $S 4 4 dp=2,tp=2)" $(measure 4 $S --strategy tensor --tp 2 "${GPT_SMALL[@]}")
row "GPT 2×32 dp=2×pp=2 m=2 (4 tasks)" "$(predicted $S 4 4 dp=2,pp=2,m=2)" $(measure 4 $S --mesh dp=2,pp=2 --micro-batches 2 "${GPT_SMALL[@]}")
row "GPT 2×32 dp=2×tp=2×pp=2 m=2 (8 tasks)" "$(predicted $S 8 4 dp=2,tp=2,pp=2,m=2)" $(measure 8 $S --mesh dp=2,tp=2,pp=2 --micro-batches 2 "${GPT_SMALL[@]}")
row "bundled GPT tp=2" "$(predicted $G 2 12 tp=2)" $(measure 2 $G --strategy tensor --tp 2 "${GPT[@]}")
row "bundled GPT dp=2" "$(predicted $G 2 12 dp=2)" $(measure 2 $G --strategy allreduce "${GPT[@]}")
row "bundled MoE GPT dp=2×ep=2" "$(predicted $M 2 12 dp=2,ep=2)" $(measure 2 $M --mesh dp=2,ep=2 "${GPT[@]}")
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
