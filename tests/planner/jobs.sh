# Sourced by the step-time scripts of tests/planner: run a dflow job one process per task on
# 127.0.0.1, as a cluster runs it and as `dflow bench calibrate` runs its jobs. Needs DFLOW (the
# binary) and SCRATCH (a scratch directory) set.

# cluster_file N: a cluster of N workers on free ports of 127.0.0.1.
cluster_file() {
  python3 - "$1" <<'PY'
import socket, sys, json
n = int(sys.argv[1]); socks = []
for _ in range(n):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); socks.append(s)
print(json.dumps({"worker": ["127.0.0.1:%d" % s.getsockname()[1] for s in socks]}))
PY
}

# run_job WORKERS TASK_ARGS GRAPH ARGS...: one run of the job on WORKERS processes, each task
# given the (space-separated) TASK_ARGS, worker 0 also GRAPH ARGS; prints `MEDIAN MEAN`, µs per
# step, from worker 0's `step time: median X µs` and `trained N steps in T s` (T/N) lines.
run_job() {
  local workers=$1 task_args=$2; shift 2
  local extra=()
  read -r -a extra <<< "$task_args"
  cluster_file "$workers" > "$SCRATCH/cluster.json"
  local others=()
  for i in $(seq 1 $((workers - 1))); do
    "$DFLOW" run --job worker --index "$i" --cluster "$SCRATCH/cluster.json" "${extra[@]}" > /dev/null 2> "$SCRATCH/err$i" &
    others+=($!)
  done
  "$DFLOW" run --job worker --index 0 --cluster "$SCRATCH/cluster.json" "${extra[@]}" "$@" > /dev/null 2> "$SCRATCH/err"
  wait "${others[@]}"
  awk '/^step time: median/ { med = $4 } /^trained [0-9]+ steps in/ { mean = $5 / $2 * 1e6 }
       END { printf "%.1f %.1f\n", med, mean }' "$SCRATCH/err"
}
