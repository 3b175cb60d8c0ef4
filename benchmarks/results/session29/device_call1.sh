#!/usr/bin/env bash
# next session (written in session 28, not run: the device time went on failed starts): the fuse modes in the hybrid
# decode (d0/d2, batch 1, 3 interleaved repeats; 48 layers, 32 GPU experts, AMXINT8, graphs), then the GGUF
# against AMXINT8 one-thread rate at T=1 (is GGUF's ~4.8 GB/s a core on the 16-core host the kernel or the pool?),
# then the GGUF op with the chain on and off. ~420 s with the build.
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1; export PYTHONPATH=/tmp/site
lscpu | grep -E "Model name" | head -1; nvidia-smi --query-gpu=name --format=csv,noheader
echo "== hybrid fuse A/B $(date +%T)"
timeout 300 python3 benchmarks/bench_hybrid_decode.py --deferred 0 2 --batch 1 --graphs on --repeat 3 \
  --fuse on,nochain,off --out "$OUT/hybrid_fuse.json" 2>&1 | grep -v Warning | tail -30
echo "== one thread $(date +%T)"
timeout 40 python3 benchmarks/bench_gguf_moe.py --types Q4_K,Q8_0 --T 1 --threads 1 --layers 2 --seconds 0.4 --profile \
  --json "$OUT/gguf_t1_threads1.json" 2>&1 | grep -v Warning | tail -6
timeout 30 python3 benchmarks/bench_cpu_moe.py --method AMXINT8 --T 1 --threads 1 --layers 2 --seconds 0.4 --profile 2>&1 \
  | grep -v Warning | tail -4
echo "== GGUF chain on/nochain $(date +%T)"
timeout 80 python3 benchmarks/bench_gguf_moe.py --types Q4_K,Q8_0 --T 1,4,16 --rounds 3 --seconds 0.3 --fuse on,nochain \
  --json "$OUT/gguf_moe.json" 2>&1 | grep -v Warning | grep median
