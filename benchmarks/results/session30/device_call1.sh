#!/usr/bin/env bash
# next session (written in session 29): (1) is a small decode task slower per byte because its items are short
# streams? the CPU op at T 1 with k 2 / 4 / 8 experts a task, items sized for 8 / 4 / 2 a thread, interleaved;
# (2) the same A/B inside the hybrid decode at deferral 0 and 2 (a d2 step runs a ~4-expert and a ~2-expert task a
# layer; session 29 measured k 2 at 0.74-0.75 of its probe, k 8 at 0.81-0.85, on the H200 host). ~330 s with the build.
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1; export PYTHONPATH=/tmp/site
lscpu | grep -E "Model name" | head -1; nvidia-smi --query-gpu=name --format=csv,noheader
echo "== CPU op: k x items per thread $(date +%T)"
for k in 2 4 8; do
  timeout 40 python3 benchmarks/bench_cpu_moe.py --method AMXINT8 --T 1 --k $k --layers 4 --seconds 0.4 \
    --items-per-thread 8,4,2,8,4,2,8,4,2 --out "$OUT/cpu_moe_ipt_k$k.json" 2>&1 | grep -E "^ AMXINT8" | sed "s/^/[k $k] /"
done
echo "== hybrid: items per thread 8 / 4 at d0 / d2 $(date +%T)"
timeout 300 python3 benchmarks/bench_hybrid_decode.py --deferred 0 2 --batch 1 --graphs on --repeat 3 \
  --items-per-thread 8,4 --out "$OUT/hybrid_ipt.json" 2>&1 | grep -v Warning | grep -E "median|best probe"
