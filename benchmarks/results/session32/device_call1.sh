#!/usr/bin/env bash
# session 32 call 1: the hand-over kernels on a GPU (tests), the prefill-graph fix (bench_decode --batch 1),
# then hybrid batch 1 d0/d2 with --handoff on,off x3 interleaved.
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1; export PYTHONPATH=/tmp/site
lscpu | grep -E "Model name" | head -1; nvidia-smi --query-gpu=name --format=csv,noheader
echo "== gpu tests $(date +%T)"
timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_handoff_triton.py \
  "tests/cpu/test_hybrid.py::test_stream_path_on_cuda" "tests/cpu/test_hybrid.py::test_split_on_cuda_matches_all_on_gpu" \
  -x -rf 2>&1 | grep -v Warning | tail -15
echo "== decode batch 1 $(date +%T)"
timeout 80 python3 benchmarks/bench_decode.py --steps 48 --batch 1 --out "$OUT/decode_b1.json" 2>&1 | grep -v Warning \
  | grep -E "tok/s|Error" | head -6
echo "== hybrid handoff A/B $(date +%T)"
timeout 280 python3 benchmarks/bench_hybrid_decode.py --deferred 0 2 --batch 1 --graphs on --handoff on,off --repeat 3 \
  --out "$OUT/hybrid_handoff_ab.json" 2>&1 | grep -v Warning | grep -E "median|best probe|Error|error|Traceback" | head -30
echo "== end $(date +%T)"
