#!/usr/bin/env bash
# next session (written in session 27, not run: no device time left): hybrid decode A/B of the fused one-token reduce (on/off interleaved in one process), deferral 0
# and 2, batch 1, 3 repeats (48 layers, 32 GPU experts, AMXINT8, graphs)
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1; export PYTHONPATH=/tmp/site
timeout 280 python3 benchmarks/bench_hybrid_decode.py --deferred 0 2 --batch 1 --graphs on --repeat 3 \
  --fused-reduce on,off --out "$OUT/hybrid_fused_reduce.json" 2>&1 | grep -v Warning | tail -40
