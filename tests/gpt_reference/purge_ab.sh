#!/bin/bash
# A/B: dflow with purging off (default now) vs MIMALLOC_PURGE_DELAY=10 (mimalloc's default, the old behaviour).
cd "$(dirname "$0")/../.."
for r in 1 2 3; do
  for v in purge10 nopurge; do
    if [ $v = purge10 ]; then export MIMALLOC_PURGE_DELAY=10; else unset MIMALLOC_PURGE_DELAY; fi
    load=$(cut -d' ' -f1 /proc/loadavg)
    out=$( { /usr/bin/time -f "TIME %U %S %e %M" ./target/release/dflow run --local examples/gpt/gpt.json --cluster examples/gpt/cluster.json --data examples/data/shakespeare.txt.gz --batch-size 12 --steps 100 --eval-every 0 --quiet; } 2>&1 )
    tps=$(echo "$out" | grep -o "trained 100 steps in [0-9.]* s ([0-9]* tokens/s)")
    t=$(echo "$out" | grep TIME)
    echo "round $r $v load $load | $tps | $t"
  done
done
unset MIMALLOC_PURGE_DELAY
