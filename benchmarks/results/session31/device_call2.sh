#!/usr/bin/env bash
# session 31 call 2: where the d0 hybrid step's GPU time goes now (memop waits, merged deferral), against the
# all-GPU step of the same shape: profile_decode all-GPU and hybrid d0/d2 (graphs on, batch 1); then a short d0/d2
# batch-1 table (3 repeats) with the CPU trace summary.
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1; export PYTHONPATH=/tmp/site
git log --oneline | head -1; lscpu | grep -E "Model name" | head -1; nvidia-smi --query-gpu=name --format=csv,noheader
echo "== profile all-GPU $(date +%T)"
timeout 100 python3 benchmarks/profile_decode.py --steps 4 --top 30 2>&1 | grep -v Warning \
  | tee "$OUT/profile_gpu.log" | tail -42
for d in 0 2; do
  echo "== profile hybrid d$d $(date +%T)"
  timeout 110 python3 benchmarks/profile_decode.py --gpu-experts 32 --deferred $d --steps 4 --top 40 --segments 6 \
    2>&1 | grep -v Warning | tee "$OUT/profile_hybrid_d$d.log" | tail -60
done
echo "== hybrid batch 1 $(date +%T)"
timeout 170 python3 benchmarks/bench_hybrid_decode.py --deferred 0 2 --batch 1 --graphs on --repeat 3 \
  --out "$OUT/hybrid_b1.json" 2>&1 | grep -v Warning | tail -30
echo "== end $(date +%T)"
