#!/usr/bin/env bash
# Too big for one process, shown on one machine: the 100M-parameter GPT
# (examples/gpt/gpt-100m.json) with 4 worker processes on 127.0.0.1, every task under the same
# --memory-limit. Plain data parallelism (--strategy allreduce) must be refused before step 1;
# ZeRO-3 and tensor parallelism (TP=4) must train STEPS steps with every process's peak RSS
# (GNU time's "Maximum resident set size") under the limit. See tests/big_model/README.md.
#
# Usage: tests/big_model/run.sh            (after `cargo build --release -p dflow`)
# Environment: DFLOW (binary, default target/release/dflow), LIMIT (bytes, default 1000000000),
# STEPS (3), BATCH (windows per step, all workers together, default 4), OUT (logs, default
# target/big_model), JOB_TIMEOUT (seconds per job, default 900), EVAL_BATCHES (held-out batches
# the chief evaluates at the end, default 0: none).
# Exit status 0 only when all three outcomes hold; the table goes to stdout and OUT/summary.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."

DFLOW=${DFLOW:-target/release/dflow}
GRAPH=examples/gpt/gpt-100m.json
DATA=examples/data/shakespeare.txt.gz
LIMIT=${LIMIT:-1000000000}
STEPS=${STEPS:-3}
BATCH=${BATCH:-4}
OUT=${OUT:-target/big_model}
JOB_TIMEOUT=${JOB_TIMEOUT:-900}
EVAL_BATCHES=${EVAL_BATCHES:-0}
WORKERS=4

[[ -x $DFLOW ]] || { echo "no $DFLOW: run cargo build --release -p dflow first" >&2; exit 2; }
[[ -x /usr/bin/time ]] || { echo "needs GNU time (/usr/bin/time; apt-get install time)" >&2; exit 2; }
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

# Four ports that were free a moment ago, on 127.0.0.1.
free_ports() {
  python3 - "$WORKERS" <<'PY'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}

# job NAME FLAGS...: runs the 4 tasks of one job under GNU time; leaves their logs in OUT/NAME
# and sets CHIEF_RC to the chief's exit status.
job() {
  local name=$1
  shift
  local dir=$OUT/$name
  rm -rf "$dir"
  mkdir -p "$dir"
  local ports addrs=()
  read -r -a ports <<<"$(free_ports)"
  for p in "${ports[@]}"; do addrs+=("\"127.0.0.1:$p\""); done
  (IFS=,; echo "{\"worker\": [${addrs[*]}]}") >"$dir/cluster.json"
  local common=(--cluster "$dir/cluster.json" --data "$DATA" --batch-size "$BATCH"
    --steps "$STEPS" --eval-batches "$EVAL_BATCHES" --timeout 600 --quiet --memory-limit "$LIMIT" "$@")
  local pids=()
  for ((i = WORKERS - 1; i >= 1; i--)); do
    /usr/bin/time -v -o "$dir/worker-$i.time" timeout "$JOB_TIMEOUT" \
      "$DFLOW" run --job worker --index "$i" "${common[@]}" \
      >"$dir/worker-$i.out" 2>"$dir/worker-$i.err" &
    pids+=($!)
  done
  CHIEF_RC=0
  /usr/bin/time -v -o "$dir/worker-0.time" timeout "$JOB_TIMEOUT" \
    "$DFLOW" run --job worker --index 0 "$GRAPH" --losses-out "$dir/losses.txt" "${common[@]}" \
    >"$dir/worker-0.out" 2>"$dir/worker-0.err" || CHIEF_RC=$?
  for pid in "${pids[@]}"; do
    # A refused job's other tasks end when the chief does (or at JOB_TIMEOUT).
    wait "$pid" || true
  done
}

# rss_bytes FILE: the peak RSS GNU time measured, in bytes.
rss_bytes() { awk -F': ' '/Maximum resident set size/ {print $2 * 1024}' "$1"; }

# report NAME: one line per task (peak RSS, the executor's variables and step-tensor peak), and
# checks every RSS is under LIMIT. Returns 1 if one is not.
report() {
  local dir=$OUT/$1 ok=0
  for ((i = 0; i < WORKERS; i++)); do
    local rss held
    rss=$(rss_bytes "$dir/worker-$i.time")
    held=$(grep -o "task:$i: holds .*" "$dir/worker-$i.err" | head -1 || true)
    say "  worker $i: peak RSS $rss B ($((rss * 100 / LIMIT))% of the limit); ${held:-no end-of-task line}"
    ((rss < LIMIT)) || { say "  worker $i: peak RSS $rss B is NOT under --memory-limit $LIMIT"; ok=1; }
  done
  say "  chief: $(grep -o 'trained .* tokens/s)' "$dir/worker-0.err" || echo 'did not train')"
  say "  losses: $(tr '\n' ' ' <"$dir/losses.txt" 2>/dev/null || true)"
  say "  $(grep -o 'validation loss: .*\|no validation loss.*' "$dir/worker-0.out" | head -1 || true)"
  return $ok
}

status=0
say "dflow $($DFLOW --version 2>/dev/null || true); $GRAPH; --memory-limit $LIMIT; $WORKERS workers on 127.0.0.1"
say "load before: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores"

say "(a) --strategy allreduce: must be refused before step 1"
job allreduce --strategy allreduce
refusal=$(grep -o "cannot fit in --memory-limit.*" "$OUT/allreduce/worker-0.err" | head -1 || true)
if ((CHIEF_RC != 0)) && [[ -n $refusal ]] && [[ ! -s $OUT/allreduce/losses.txt ]]; then
  say "  refused: ${refusal}"
else
  say "  NOT refused as expected (chief exit $CHIEF_RC); see $OUT/allreduce"
  status=1
fi

say "(b) --strategy zero --zero-stage 3: must train $STEPS steps under the limit"
job zero3 --strategy zero --zero-stage 3
((CHIEF_RC == 0)) || { say "  the chief failed (exit $CHIEF_RC): $(tail -3 "$OUT/zero3/worker-0.err")"; status=1; }
report zero3 || status=1

say "(c) --strategy tensor --tp 4: must train $STEPS steps under the limit"
job tp4 --strategy tensor --tp 4
((CHIEF_RC == 0)) || { say "  the chief failed (exit $CHIEF_RC): $(tail -3 "$OUT/tp4/worker-0.err")"; status=1; }
report tp4 || status=1

say "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
((status == 0)) && say "OK" || say "FAILED"
exit $status
