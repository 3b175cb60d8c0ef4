#!/usr/bin/env bash
# session 32 call 2: the done1 fix and the hand-over kernels on a GPU (stream-path tests), then batch-1 hybrid decode
# d0 / d2 merged / d2 unmerged x3 interleaved (merged d2 was measured before with the done1 bug). On an H200 host
# also the CPU MoE op AMXINT8/AMXINT4 at T 1..4096 (issue 16 point 3).
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1; export PYTHONPATH=/tmp/site
lscpu | grep -E "Model name" | head -1; gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
echo "== gpu tests $(date +%T)"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_handoff_triton.py \
  "tests/cpu/test_hybrid.py::test_stream_path_on_cuda" "tests/cpu/test_hybrid_deepseek.py::test_deepseek_split_on_cuda_matches_all_on_gpu" \
  "tests/lora/test_lora_cpu_experts.py::test_cuda_graphs_cpu_expert_lora" -rf 2>&1 | grep -v Warning | tail -8
echo "== hybrid d0 / d2 merged / unmerged, batch 1 $(date +%T)"
timeout 190 python3 benchmarks/bench_hybrid_decode.py --deferred 0 2 --merge-deferred on,off --batch 1 --graphs on \
  --repeat 3 --out "$OUT/hybrid_decode.json" 2>&1 | grep -v Warning | grep -E "median|best probe|Error|error|Traceback" | head -30
echo "== end $(date +%T)"
