#!/usr/bin/env bash
# session 30 call 3: memop waits (now the default) and the merged now+deferred task: (1) the GPU stream-path test
# (both waits, graphs off/on, deferral 0/1: the merged task at one token), the CPU-expert LoRA and DeepSeek hybrid
# GPU tests; (2) hybrid decode d0 / d2 merged / d2 unmerged, batch 1 4 16, 3 interleaved repeats
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1; export PYTHONPATH=/tmp/site
lscpu | grep -E "Model name" | head -1; nvidia-smi --query-gpu=name --format=csv,noheader
echo "== gpu tests $(date +%T)"
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/cpu/test_hybrid.py tests/lora/test_lora_cpu_experts.py \
  tests/cpu/test_hybrid_deepseek.py -k "stream or split" -rf 2>&1 | tee "$OUT/gpu_tests.log" \
  | grep -E "FAILED|ERROR|passed|failed|^E " | tail -15
echo "== hybrid: d0 / d2 merged / d2 unmerged (memop) $(date +%T)"
timeout 250 python3 benchmarks/bench_hybrid_decode.py --deferred 0 2 --batch 1 4 16 --graphs on --repeat 3 \
  --stream-wait memop --merge-deferred off,on --out "$OUT/hybrid_merge.json" 2>&1 | grep -v Warning \
  | grep -E "median|best probe|CPU trace|Error|error" | head -40
