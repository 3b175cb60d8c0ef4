#!/usr/bin/env bash
# session 28 call 1 (short: the device time went on failed starts): the fused light phases (one-token reduce,
# few-row activation conversion, chained down items), CPU op A/B by mode with the phase profile, 15 threads
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1; export PYTHONPATH=/tmp/site
lscpu | grep -E "Model name" | head -1; nvidia-smi --query-gpu=name --format=csv,noheader
echo "== cpu op AMXINT8 fuse modes $(date +%T)"
timeout 60 python3 benchmarks/bench_cpu_moe.py --method AMXINT8 --T 1,4 --fuse on,nochain,off,quant,reduce,on,nochain,off,quant,reduce \
  --profile --seconds 0.4 --layers 6 --out "$OUT/cpu_moe_fuse.json" 2>&1 | grep -v Warning | tail -24
