#!/usr/bin/env bash
# session 27 call 1: MLA decode P_VIA_MEM form + chunked merge: GPU tests, the tile sweep, the absorbed bmms alone
nvidia-smi --query-gpu=name --format=csv,noheader
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1
export PYTHONPATH=/tmp/site
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mla_triton_gpu.py -rf 2>&1 > "$OUT/gpu_tests_mla_call1.log"
grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests_mla_call1.log" | tail -8
timeout 60 python3 benchmarks/results/session27/absorb_bmm.py "$OUT/absorb_bmm.json" 2>&1 | grep -v Warn | tail -5
timeout 300 python3 benchmarks/bench_mla_decode.py --sweep --out "$OUT/mla_sweep.json" 2>&1 | grep -v Warn > "$OUT/mla_sweep.log"
tail -100 "$OUT/mla_sweep.log"
