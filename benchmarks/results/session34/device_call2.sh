#!/usr/bin/env bash
# session 34 call 2: CPU MoE op AMXINT8/AMXINT4 (issue 16 pt 3), all-GPU decode b1/b64 (pt 5), MLA (issue 15)
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
CPU_MOE_ARGS="--T 1,4,16,1024,4096 --seconds 0.4" timeout 200 bash benchmarks/run_device_suite.sh "$OUT" cpu-moe 2>&1 | grep -E "==|T=|TFLOP|GB/s" | tail -24
DECODE_ARGS="--batch 1 64 --graphs on" DECODE_TIMEOUT=150 bash benchmarks/run_device_suite.sh "$OUT" decode 2>&1 | tail -8
MLA_TIMEOUT=200 bash benchmarks/run_device_suite.sh "$OUT" mla 2>&1 | tail -22
echo "== end $(date +%T)"
