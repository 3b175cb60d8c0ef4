#!/usr/bin/env bash
# session 29 call 2: GGUF next-block prefetch (CPUThreadPool.block_prefetch 0/1/2) at one thread (hot and cold
# weights) and 15 threads; AMXINT8 one thread hot/cold for scale; the deferral split cost (k 8 vs 4 a task)
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1; export PYTHONPATH=/tmp/site
lscpu | grep -E "Model name" | head -1; nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline | head -1
echo "== gguf tests avx512 $(date +%T)"
HYBRIDMOE_CPU_ISA=avx512 timeout 60 python3 -m pytest -q -p no:cacheprovider tests/cpu/test_gguf_kernels.py -k "chained or direct" 2>&1 | tail -2
echo "== GGUF one thread hot (E 8, k 8, 1 layer) $(date +%T)"
timeout 60 python3 benchmarks/bench_gguf_moe.py --types Q4_K,Q8_0 --T 1 --threads 1 --E 8 --k 8 --layers 1 --seconds 0.3 \
  --block-prefetch 0,1,2 --rounds 2 --json "$OUT/gguf_t1_hot.json" 2>&1 | grep -E "median|probe best"
echo "== GGUF one thread cold $(date +%T)"
timeout 60 python3 benchmarks/bench_gguf_moe.py --types Q4_K,Q8_0 --T 1 --threads 1 --layers 2 --seconds 0.3 \
  --block-prefetch 0,1,2 --rounds 2 --json "$OUT/gguf_t1_cold.json" 2>&1 | grep -E "median|probe best"
echo "== AMXINT8 one thread hot / cold $(date +%T)"
timeout 40 python3 benchmarks/bench_cpu_moe.py --method AMXINT8 --T 1 --threads 1 --E 8 --k 8 --layers 1 --seconds 0.3 2>&1 | grep -E "^ AMXINT8|best stream"
timeout 40 python3 benchmarks/bench_cpu_moe.py --method AMXINT8 --T 1 --threads 1 --layers 2 --seconds 0.3 2>&1 | grep -E "^ AMXINT8|best stream"
echo "== GGUF 15 threads $(date +%T)"
timeout 150 python3 benchmarks/bench_gguf_moe.py --types Q4_K,Q8_0 --T 1,4,16 --seconds 0.3 --block-prefetch 0,1,2 --rounds 3 \
  --json "$OUT/gguf_moe_bp.json" 2>&1 | grep -E "median|probe best"
echo "== task size k 8 / 4 $(date +%T)"
for r in 1 2; do for k in 8 4; do
  timeout 40 python3 benchmarks/bench_cpu_moe.py --method AMXINT8 --T 1 --k $k --seconds 0.5 2>&1 | grep -E "^ AMXINT8" | sed "s/^/[k $k] /"
done; done
echo "== end $(date +%T)"
