#!/usr/bin/env bash
# session 29 call 3: hybrid decode of the 48-layer Qwen3-30B-A3B shape from a Q4_K GGUF (issue 18), batch 1,
# deferral 0, graphs on, the next-block prefetch on (default) and off, 2 interleaved repeats; first the CPU op's
# tasks back to back against 100 us apart (does a pool that idles between tasks read faster per task?)
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1; export PYTHONPATH=/tmp/site
lscpu | grep -E "Model name" | head -1; nvidia-smi --query-gpu=name --format=csv,noheader
echo "== CPU MoE tasks back to back against 100 us apart (AMXINT8, T 1, k 8) $(date +%T)"
timeout 60 python3 benchmarks/bench_cpu_moe.py --method AMXINT8 --T 1 --seconds 0.6 --gap-us 0,100,0,100,0,100 \
  --out "$OUT/cpu_moe_gap.json" 2>&1 | grep -E "AMXINT8|best stream"
echo "== hybrid GGUF $(date +%T)"
timeout 380 python3 benchmarks/bench_hybrid_decode.py --gguf Q4_K --gguf-dir /tmp/hm_gguf --deferred 0 --batch 1 \
  --graphs on --block-prefetch 1,0 --repeat 2 --out "$OUT/hybrid_decode_gguf.json" 2>&1 | grep -v Warning | tail -16
echo "== end $(date +%T)"
