#!/usr/bin/env bash
# next session (written in session 31; ~520 s with the build): (1) bench_decode --batch 1, which faulted at startup
# in session 31 (144 KV tokens under the 512 prefill-graph tokens) before the clamp of 75ddc27, never run since;
# (2) on an H200 host, issue 16's tables with today's defaults: hybrid d0/d2 batch 1 4 16 x3 (memop waits, merged
# deferral), the CPU MoE op AMXINT8/AMXINT4 at T 1..4096.
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1; export PYTHONPATH=/tmp/site
lscpu | grep -E "Model name" | head -1; nvidia-smi --query-gpu=name --format=csv,noheader
echo "== decode batch 1 $(date +%T)"
timeout 90 python3 benchmarks/bench_decode.py --steps 48 --batch 1 --out "$OUT/decode_b1.json" 2>&1 | grep -v Warning \
  | grep -E "tok/s|Error" | head -6
echo "== hybrid table $(date +%T)"
timeout 230 python3 benchmarks/bench_hybrid_decode.py --deferred 0 2 --batch 1 4 16 --graphs on --repeat 3 \
  --out "$OUT/hybrid_decode.json" 2>&1 | grep -v Warning | grep -E "median|best probe|Error|error" | head -30
echo "== cpu-moe $(date +%T)"
for m in AMXINT8 AMXINT4; do
  timeout 100 python3 benchmarks/bench_cpu_moe.py --method $m --T 1,4,16,1024,4096 --seconds 0.5 \
    --out "$OUT/cpu_moe_$m.json" 2>&1 | grep -v Warning | tail -9
done
echo "== end $(date +%T)"
