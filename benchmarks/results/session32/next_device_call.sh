#!/usr/bin/env bash
# next session (written in session 32, never run: the budget ran out): short; on an H200 host issue 16 points 1-2 at
# batch 1 (d0 / d2 merged, with the done1 fix and the hand-over kernels), then point 3's CPU MoE op (AMXINT4 and
# AMXINT8 interleaved). ~200 s with the build.
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1; export PYTHONPATH=/tmp/site
lscpu | grep -E "Model name" | head -1; nvidia-smi --query-gpu=name --format=csv,noheader
echo "== hybrid d0 / d2, batch 1 $(date +%T)"
timeout 110 python3 benchmarks/bench_hybrid_decode.py --deferred 0 2 --batch 1 --graphs on --repeat 3 \
  --out "$OUT/hybrid_decode.json" 2>&1 | grep -v Warning | grep -E "median|best probe|Error|error|Traceback" | head -10
echo "== cpu-moe $(date +%T)"
timeout 80 python3 benchmarks/bench_cpu_moe.py --method AMXINT4,AMXINT8 --T 1,16,1024,4096 --seconds 0.4 \
  --out "$OUT/cpu_moe.json" 2>&1 | grep -v Warning | tail -12
echo "== end $(date +%T)"
