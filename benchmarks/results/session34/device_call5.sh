#!/usr/bin/env bash
# session 34 call 5: the decode kernels' software prefetch distance, 2048 (Intel default) against 4096, interleaved:
# AMXINT8/AMXINT4 at T 1, 4, 16 in three processes (order alternating), GGUF Q4_K/Q8_0 3 rounds; first the real-AMX
# CPU kernel tests (with the gguf wheel this time) on this commit's library.
export PYTHONPATH=$PWD:/tmp/site HYBRIDMOE_AMX_EMULATE=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
python3 benchmarks/results/session34/build_lib.py hybridmoe/cpu/csrc /tmp/lib.so; export HYBRIDMOE_CPU_LIB=/tmp/lib.so
lscpu | grep -E "Model name" | head -1; git log --oneline 2>/dev/null | head -1
echo "== real AMX tests $(date +%T)"
HYBRIDMOE_CPU_ISA=amx HYBRIDMOE_TEST_THREADS=8 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/cpu/test_cpu_kernels.py \
  tests/cpu/test_cpu_lora.py tests/cpu/test_cpu_engine.py tests/cpu/test_gguf_kernels.py --tb=line 2>&1 | grep -E "^(FAILED|ERROR|E  )|passed|failed" | head -8
i=0
for order in 2048,4096 4096,2048 2048,4096; do
  echo "== amx pf $order $(date +%T)"
  timeout 70 python3 benchmarks/bench_cpu_moe.py --method AMXINT8,AMXINT4 --T 1,4,16 --prefetch $order --seconds 0.4 \
    --out "$OUT/pf_amx_$i.json" 2>&1 | grep -E "^ +AMXINT|best stream"; i=$((i + 1))
done
echo "== gguf pf $(date +%T)"
timeout 130 python3 benchmarks/bench_gguf_moe.py --types Q4_K,Q8_0 --T 1,4,16 --prefetch 2048,4096 --rounds 3 \
  --json "$OUT/pf_gguf.json" 2>&1 | grep -E "^(kernel|median)"
echo "== end $(date +%T)"
