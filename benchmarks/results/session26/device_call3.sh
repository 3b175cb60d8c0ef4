#!/usr/bin/env bash
# session 26 call 3: decode-path kernels (one-token MoE without align, recorder count kernel, skinny GEMV)
nvidia-smi --query-gpu=name --format=csv,noheader
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1
export PYTHONPATH=/tmp/site
timeout 90 python3 benchmarks/bench_skinny.py --out "$OUT/skinny.json" 2>&1 | grep -v Warning | tail -14
timeout 200 python3 benchmarks/ab_decode_kernels.py --rounds 3 --out "$OUT/ab_decode.json" 2>&1 | grep -v Warning | tail -9
HYBRIDMOE_SKINNY_GEMV=1 timeout 80 python3 benchmarks/profile_decode.py --top 30 2>&1 | grep -v Warning | grep -E "per step|GPU operations|^ +[0-9]" | head -34 | tee "$OUT/profile_b1_skinny.log"
HYBRIDMOE_SKINNY_GEMV=1 timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_skinny.py tests/test_recorder_kernel.py tests/test_triton_moe.py tests/test_prefill_graph_gpu.py tests/test_parity.py -rf 2>&1 | tail -12 | tee "$OUT/gpu_tests_call3.log"
