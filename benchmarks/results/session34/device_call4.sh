#!/usr/bin/env bash
# session 34 call 4: AMX INT4 prefill A/B in one call: v0 = b9f9cf2 (u8 nibbles, TDPBSUD, 8*gsum per group),
# v1 = bdefd08 (s8 u-8, TDPBSSD), v2 = working tree (v1 + group g+1's tile dots issued before group g's pass);
# each its own library (build_lib.py, HYBRIDMOE_CPU_LIB), processes interleaved v0/v1/v2 in rotating order,
# 3 rounds, AMXINT8 in every process as the reference. Then the real-AMX CPU kernel tests on v2, asym INT4,
# and the decode-size prefetch distance 2048 / 4096 of the AMX kernels (GGUF: call 3).
export PYTHONPATH=$PWD HYBRIDMOE_AMX_EMULATE=0 PYTHONUNBUFFERED=1
lscpu | grep -E "Model name" | head -1; nvidia-smi --query-gpu=name --format=csv,noheader
S=benchmarks/results/session34/build_lib.py
python3 $S _v0/hybridmoe/cpu/csrc /tmp/v0.so & python3 $S _v1/hybridmoe/cpu/csrc /tmp/v1.so & python3 $S hybridmoe/cpu/csrc /tmp/v2.so & wait
echo "== real AMX tests on v2 $(date +%T)"
HYBRIDMOE_CPU_LIB=/tmp/v2.so HYBRIDMOE_CPU_ISA=amx HYBRIDMOE_TEST_THREADS=8 timeout 150 python3 -m pytest -q -p no:cacheprovider \
  tests/cpu/test_cpu_kernels.py tests/cpu/test_cpu_lora.py tests/cpu/test_cpu_engine.py --tb=line 2>&1 | grep -E "^(FAILED|ERROR|E  )|passed|failed" | head -12
mkdir -p /tmp/ab
echo "== A/B $(date +%T)"
vs=(v0 v1 v2)
for r in 0 1 2; do
  for i in 0 1 2; do
    v=${vs[$(( (i + r) % 3 ))]}
    HYBRIDMOE_CPU_LIB=/tmp/$v.so timeout 80 python3 benchmarks/bench_cpu_moe.py --method AMXINT4,AMXINT8 --T 1024,4096 \
      --seconds 0.6 --out /tmp/ab/${v}_r$r.json 2>&1 | grep -E "^ +AMXINT[48] +(1024|4096) " | sed "s/^/$v r$r /"
  done
done
echo "== asym $(date +%T)"
for v in v0 v2 v0 v2; do
  HYBRIDMOE_CPU_LIB=/tmp/$v.so timeout 60 python3 benchmarks/bench_cpu_moe.py --method AMXINT4 --asym --T 1024,4096 \
    --seconds 0.6 2>&1 | grep -E "^ +AMXINT4 +(1024|4096) " | sed "s/^/$v asym /"
done
echo "== prefetch $(date +%T)"
HYBRIDMOE_CPU_LIB=/tmp/v2.so timeout 150 python3 benchmarks/bench_cpu_moe.py --method AMXINT8,AMXINT4 --T 1,4,16 \
  --prefetch 2048,4096 --seconds 0.5 --out /tmp/ab/prefetch.json 2>&1 | grep -v Warning | tail -16
tar czf "$OUT/ab.tgz" -C /tmp ab
echo "== end $(date +%T)"
