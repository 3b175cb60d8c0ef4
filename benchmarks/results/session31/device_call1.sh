#!/usr/bin/env bash
# session 31 call 1: issue 16's tables on the issues' machine with today's defaults (memop waits, merged deferred
# tasks): hybrid d0/d2 batch 1 4 16 x3; the CPU MoE op AMXINT8/AMXINT4 at T 1..4096; all-GPU decode.
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1; export PYTHONPATH=/tmp/site
git log --oneline | head -1; lscpu | grep -E "Model name" | head -1; nvidia-smi --query-gpu=name --format=csv,noheader
echo "== hybrid table $(date +%T)"
timeout 230 python3 benchmarks/bench_hybrid_decode.py --deferred 0 2 --batch 1 4 16 --graphs on --repeat 3 \
  --out "$OUT/hybrid_decode.json" 2>&1 | grep -v Warning | grep -E "median|best probe|bound|Error|error" | head -30
echo "== cpu-moe $(date +%T)"
for m in AMXINT8 AMXINT4; do
  timeout 110 python3 benchmarks/bench_cpu_moe.py --method $m --T 1,4,16,1024,4096 --seconds 0.5 \
    --out "$OUT/cpu_moe_$m.json" 2>&1 | grep -v Warning | tail -9
done
echo "== decode $(date +%T)"
timeout 150 python3 benchmarks/bench_decode.py --steps 48 --out "$OUT/decode.json" 2>&1 | grep -v Warning | tail -14
echo "== end $(date +%T)"
