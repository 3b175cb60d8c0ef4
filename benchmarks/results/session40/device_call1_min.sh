#!/usr/bin/env bash
# Session 40 call 1, minimal (~200 s, the budget left): as device_call1.sh, but the real-AMX tests of the INT4 and
# FP8 kernels only, then v0 / v1 / v0 / v1 processes at T 1024 and 4096 (AMXINT4 with AMXINT8 as the reference).
export PYTHONPATH=$PWD HYBRIDMOE_AMX_EMULATE=0 PYTHONUNBUFFERED=1
lscpu | grep -E "Model name" | head -1; nvidia-smi --query-gpu=name --format=csv,noheader
S=benchmarks/results/session34/build_lib.py
python3 $S benchmarks/results/session40/v0_csrc /tmp/v0.so & python3 $S hybridmoe/cpu/csrc /tmp/v1.so & wait
echo "== real AMX tests on v1 $(date +%T)"
HYBRIDMOE_CPU_LIB=/tmp/v1.so HYBRIDMOE_CPU_ISA=amx HYBRIDMOE_TEST_THREADS=8 timeout 90 python3 -m pytest -q -p no:cacheprovider \
  tests/cpu/test_cpu_kernels.py tests/cpu/test_cpu_fp8.py -k "int4 or fp8 or FP8" --tb=line 2>&1 | grep -E "^(FAILED|ERROR|E  )|passed|failed" | head -12
echo "== A/B $(date +%T)"
for v in v0 v1 v0 v1; do
  HYBRIDMOE_CPU_LIB=/tmp/$v.so timeout 60 python3 benchmarks/bench_cpu_moe.py --method AMXINT4,AMXINT8 --T 1024,4096 \
    --seconds 0.3 2>&1 | grep -E "^ +AMXINT[48] +(1024|4096) " | sed "s/^/$v /"
done
echo "== end $(date +%T)"
