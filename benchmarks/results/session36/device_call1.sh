#!/usr/bin/env bash
# session 36 call 1: (a) the MLA decode kernel's mixed form (TRANS 2) against the plain default tile
# (bench_mla_decode.py --sweep, 6 shapes); (b) the GGUF direct-kernel rework (Q4_K/Q5_K dword-lane layout,
# Q8_0 fdot8, N-block row sums) A/B: v0 = HEAD's csrc (_v0/, carried untracked), v1 = the working tree, each its
# own library (session34/build_lib.py, HYBRIDMOE_CPU_LIB), processes alternating, 3 rounds; (c) the GGUF kernel
# tests on real AMX / AVX-512 with v1; (d) the MLA GPU tests.
export PYTHONPATH=$PWD HYBRIDMOE_AMX_EMULATE=0 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
lscpu | grep -E "Model name" | head -1; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
S=benchmarks/results/session34/build_lib.py
(python3 $S _v0/hybridmoe/cpu/csrc /tmp/v0.so > /tmp/b0.log 2>&1; python3 $S hybridmoe/cpu/csrc /tmp/v1.so > /tmp/b1.log 2>&1) &
BUILD=$!
echo "== MLA sweep $(date +%T)"
timeout 230 python3 benchmarks/bench_mla_decode.py --sweep --sweep-tiles 64,64,8,2 64,32,8,2,2 64,32,8,3,2 \
  64,16,8,2,2 64,64,8,2,2 --out $OUT/mla_sweep.json 2>&1 | grep -v -i "warn"
wait $BUILD; tail -1 /tmp/b0.log /tmp/b1.log
echo "== GGUF A/B $(date +%T)"
mkdir -p $OUT/gguf_ab
for r in 0 1 2; do
  if [ $r = 1 ]; then order="v1 v0"; else order="v0 v1"; fi
  for v in $order; do
    HYBRIDMOE_CPU_LIB=/tmp/$v.so timeout 60 python3 benchmarks/bench_gguf_moe.py --types Q4_K,Q8_0 --T 1,4,16 \
      --seconds 0.4 --json $OUT/gguf_ab/${v}_r$r.json 2>&1 | grep -E "probe|^Q" | sed "s/^/$v r$r /"
  done
done
echo "== GGUF kernel tests, real AMX, v1 $(date +%T)"
HYBRIDMOE_CPU_LIB=/tmp/v1.so HYBRIDMOE_CPU_ISA=amx HYBRIDMOE_TEST_THREADS=8 timeout 100 python3 -m pytest -q -x \
  -p no:cacheprovider tests/cpu/test_gguf_kernels.py --tb=line 2>&1 | tail -3
echo "== MLA GPU tests $(date +%T)"
timeout 90 python3 -m pytest -q -x -m gpu tests/test_mla_triton_gpu.py -p no:cacheprovider --tb=line 2>&1 | tail -3
echo "== end $(date +%T)"
