#!/usr/bin/env bash
# session 26 call 2: all-GPU decode (model and spread routing), batch-1 and batch-64 profiles
nvidia-smi --query-gpu=name --format=csv,noheader
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1
export PYTHONPATH=/tmp/site
timeout 170 python3 benchmarks/bench_decode.py --steps 48 --graphs on --out "$OUT/decode_model.json" 2>&1 | grep -v Warning | tail -8
timeout 170 python3 benchmarks/bench_decode.py --steps 48 --graphs on --routing spread --out "$OUT/decode_spread.json" 2>&1 | grep -v Warning | tail -8
timeout 110 python3 benchmarks/profile_decode.py --top 40 2>&1 | grep -v Warning | tail -48 | tee "$OUT/profile_b1.log"
timeout 110 python3 benchmarks/profile_decode.py --batch 64 --routing spread --top 25 2>&1 | grep -v Warning | tail -32 | tee "$OUT/profile_b64.log"
