#!/usr/bin/env bash
# next session (written in session 30): (1) where the d0 hybrid step's GPU path goes now that the stream waits by
# memory operations (profile_decode, 32 GPU experts, d0 and d2); (2) on an H200 host, issue 16's hybrid table with
# the new defaults (memop waits, merged deferred tasks): d0 / d2 at batch 1 4 16, 3 repeats. ~420 s with the build.
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1; export PYTHONPATH=/tmp/site
lscpu | grep -E "Model name" | head -1; nvidia-smi --query-gpu=name --format=csv,noheader
for d in 0 2; do
  echo "== profile hybrid d$d $(date +%T)"
  timeout 90 python3 benchmarks/profile_decode.py --gpu-experts 32 --deferred $d --steps 4 --top 40 --segments 4 \
    2>&1 | grep -v Warning | tee "$OUT/profile_hybrid_d$d.log" | tail -60
done
echo "== hybrid table $(date +%T)"
timeout 240 python3 benchmarks/bench_hybrid_decode.py --deferred 0 2 --batch 1 4 16 --graphs on --repeat 3 \
  --out "$OUT/hybrid_decode.json" 2>&1 | grep -v Warning | grep -E "median|best probe|Error|error" | head -30
