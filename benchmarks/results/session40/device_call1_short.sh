#!/usr/bin/env bash
# Session 40 call 1, short (the budget left): 2 rounds, no FP8, no asym. Otherwise as device_call1.sh: AMX INT4 prefill A/B in one call. v0 = 86e5d8f's kernel (unpack the whole block pair, then
# 32-row passes, each over every K group), v1 = working tree (per block pair: K group outer, the group unpacked
# into a 4 KiB L1 buffer used by every pass; the scale pass of one (group, pass) runs while the next one's tile
# dots compute). Each its own library (session34/build_lib.py, HYBRIDMOE_CPU_LIB); processes alternate v0/v1,
# first the real-AMX CPU tests on v1; then 3 rounds, AMXINT8 in every process as the reference; FP8 (same loop change) beside them; then asym once each.
# v0's sources travel untracked in session40/v0_csrc (not committed).
export PYTHONPATH=$PWD HYBRIDMOE_AMX_EMULATE=0 PYTHONUNBUFFERED=1
lscpu | grep -E "Model name" | head -1; nvidia-smi --query-gpu=name --format=csv,noheader
S=benchmarks/results/session34/build_lib.py
python3 $S benchmarks/results/session40/v0_csrc /tmp/v0.so & python3 $S hybridmoe/cpu/csrc /tmp/v1.so & wait
echo "== real AMX tests on v1 $(date +%T)"
HYBRIDMOE_CPU_LIB=/tmp/v1.so HYBRIDMOE_CPU_ISA=amx HYBRIDMOE_TEST_THREADS=8 timeout 120 python3 -m pytest -q -p no:cacheprovider \
  tests/cpu/test_cpu_kernels.py tests/cpu/test_cpu_fp8.py tests/cpu/test_layer_moe.py --tb=line 2>&1 | grep -E "^(FAILED|ERROR|E  )|passed|failed" | head -12
mkdir -p /tmp/ab
echo "== A/B $(date +%T)"
for r in 0 1; do
  for v in $([ $r = 1 ] && echo v1 v0 || echo v0 v1); do
    HYBRIDMOE_CPU_LIB=/tmp/$v.so timeout 90 python3 benchmarks/bench_cpu_moe.py --method AMXINT4,AMXINT8 --T 1024,4096 \
      --seconds 0.5 --out /tmp/ab/${v}_r$r.json 2>&1 | grep -E "^ +(AMXINT[48]|FP8) +(1024|4096) " | sed "s/^/$v r$r /"
  done
done
tar czf "$OUT/ab.tgz" -C /tmp ab
echo "== end $(date +%T)"
