#!/usr/bin/env bash
# Alternates dflow and PyTorch on the GPT (nanoGPT CPU config), N steps each, R rounds.
cd "$(dirname "$0")/../.."
N=${N:-300}; R=${R:-3}
for r in $(seq 1 $R); do
  l=$(cut -d' ' -f1 /proc/loadavg)
  d=$(target/release/dflow run --local examples/gpt/gpt.json --cluster examples/gpt/cluster.json --data examples/data/shakespeare.txt.gz --batch-size 12 --steps $N --eval-every 0 --eval-batches 1 --quiet 2>&1 | grep -o '([0-9]* tokens/s)' | tr -dc 0-9)
  p=$(~/.cache/dflow-peers/venv/bin/python tests/gpt_reference/torch_gpt.py bench --data examples/data/shakespeare.txt.gz --iters $N --threads 2 --eval-batches 1 2>/dev/null | python3 -c 'import json,sys;print(json.load(sys.stdin)["tokens_per_s"])')
  echo "round $r load $l dflow $d pytorch $p ratio $(python3 -c "print(round($d/$p,2))")"
done
