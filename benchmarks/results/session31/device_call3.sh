#!/usr/bin/env bash
# session 31 call 3: the router's new config (1, 2048, 4): its GPU tests, then the all-GPU batch-1 decode and a profile
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1; export PYTHONPATH=/tmp/site
git log --oneline | head -1; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_router_triton.py tests/test_routing_triton.py tests/test_recorder_kernel.py 2>&1 | tail -3
timeout 100 python3 benchmarks/profile_decode.py --steps 4 --top 8 2>&1 | grep -v Warning | sed -n 1,14p
timeout 150 python3 benchmarks/bench_decode.py --steps 48 --batch 1 --out "$OUT/decode_b1.json" 2>&1 | grep -v Warning | tail -6
