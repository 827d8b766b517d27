#!/usr/bin/env bash
# The bundled GPT (examples/gpt/gpt.json, Ψ = 811,264) on 2 worker processes on 127.0.0.1 under
# plain data parallelism, ZeRO-1/2/3 and TP=2, alternated for ROUNDS rounds: per job, each
# worker's peak RSS (GNU time), its executor's variable bytes and step-tensor peak, and the
# chief's steps/s. Writes OUT/table.tsv (one row per job and worker) and prints it.
#
# Usage: tests/big_model/gpt_table.sh    (after `cargo build --release -p dflow`)
# Environment: DFLOW (target/release/dflow), ROUNDS (3), STEPS (30), BATCH (12), OUT
# (target/gpt_table), JOB_TIMEOUT (300 s per job).
set -euo pipefail
cd "$(dirname "$0")/../.."

DFLOW=${DFLOW:-target/release/dflow}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-30}
BATCH=${BATCH:-12}
OUT=${OUT:-target/gpt_table}
JOB_TIMEOUT=${JOB_TIMEOUT:-300}

[[ -x $DFLOW ]] || { echo "no $DFLOW: run cargo build --release -p dflow first" >&2; exit 2; }
[[ -x /usr/bin/time ]] || { echo "needs GNU time (/usr/bin/time; apt-get install time)" >&2; exit 2; }
mkdir -p "$OUT"
TABLE=$OUT/table.tsv
printf 'round\tstrategy\tworker\tpeak_rss_B\tvariables_B\tstep_peak_B\tsteps_per_s\n' >"$TABLE"

free_ports() {
  python3 -c 'import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(" ".join(str(x.getsockname()[1]) for x in s))'
}

# job ROUND NAME FLAGS...: one 2-worker job; appends its rows to TABLE.
job() {
  local round=$1 name=$2
  shift 2
  local dir=$OUT/$round-$name ports
  rm -rf "$dir"
  mkdir -p "$dir"
  read -r -a ports <<<"$(free_ports)"
  echo "{\"worker\": [\"127.0.0.1:${ports[0]}\", \"127.0.0.1:${ports[1]}\"]}" >"$dir/cluster.json"
  local common=(--cluster "$dir/cluster.json" --data examples/data/shakespeare.txt.gz
    --batch-size "$BATCH" --steps "$STEPS" --eval-batches 0 --quiet "$@")
  /usr/bin/time -v -o "$dir/worker-1.time" timeout "$JOB_TIMEOUT" \
    "$DFLOW" run --job worker --index 1 "${common[@]}" >"$dir/worker-1.out" 2>"$dir/worker-1.err" &
  local other=$!
  /usr/bin/time -v -o "$dir/worker-0.time" timeout "$JOB_TIMEOUT" \
    "$DFLOW" run --job worker --index 0 examples/gpt/gpt.json "${common[@]}" \
    >"$dir/worker-0.out" 2>"$dir/worker-0.err" || { echo "$name failed: see $dir" >&2; return 1; }
  wait "$other" || { echo "$name worker 1 failed: see $dir" >&2; return 1; }
  # "trained N steps in S s": the chief's training time, start-up excluded.
  local rate
  rate=$(sed -n 's/^trained \([0-9]*\) steps in \([0-9.]*\) s.*/\1 \2/p' "$dir/worker-0.err" |
    awk '{printf "%.3f", $1 / $2}')
  for i in 0 1; do
    local rss held vars peak
    rss=$(awk -F': ' '/Maximum resident set size/ {print $2 * 1024}' "$dir/worker-$i.time")
    held=$(grep -o "task:$i: holds .*" "$dir/worker-$i.err" | head -1)
    vars=$(sed -n 's/.*variables, \([0-9]*\) bytes;.*/\1/p' <<<"$held")
    peak=$(sed -n 's/.*peaked at \([0-9]*\) bytes;.*/\1/p' <<<"$held")
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$round" "$name" "$i" "$rss" "$vars" "$peak" "$rate" >>"$TABLE"
  done
}

echo "load before: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores, $(date -u +%H:%M) UTC"
for ((r = 1; r <= ROUNDS; r++)); do
  job "$r" dp --strategy allreduce
  job "$r" zero1 --strategy zero --zero-stage 1
  job "$r" zero2 --strategy zero --zero-stage 2
  job "$r" zero3 --strategy zero --zero-stage 3
  job "$r" tp2 --strategy tensor --tp 2
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%H:%M) UTC"
column -t "$TABLE"
