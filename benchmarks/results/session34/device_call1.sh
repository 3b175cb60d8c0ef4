#!/usr/bin/env bash
# session 34 call 1: the gate-timeout settle on CUDA (new GPU test) and the stream path; hybrid decode d0/d2 at
# batch 1, 4, 16 (issue 16 points 1-2), graphs on, 3 interleaved repeats.
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1; export PYTHONPATH=/tmp/site
lscpu | grep -E "Model name" | head -1; nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline | head -1
echo "== gpu tests $(date +%T)"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
  "tests/cpu/test_hybrid.py::test_a_task_skipped_at_the_gate_timeout_on_cuda" \
  "tests/cpu/test_hybrid.py::test_stream_path_on_cuda" -rf 2>&1 | grep -v Warning | tail -6
echo "== hybrid d0 / d2, batch 1 4 16 $(date +%T)"
timeout 330 python3 benchmarks/bench_hybrid_decode.py --deferred 0 2 --batch 1 4 16 --graphs on --repeat 3 \
  --out "$OUT/hybrid_decode.json" 2>&1 | grep -v Warning | grep -E "median|best probe|Error|error|Traceback" | head -30
echo "== end $(date +%T)"
