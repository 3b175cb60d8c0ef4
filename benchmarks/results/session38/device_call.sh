#!/usr/bin/env bash
# Session 38: one call that uses whichever GPU comes. Carry .whl.
# - H200: every issue table but serving (session38/h200_one_call.sh, ~420 s), then the GPU tests below in the time left.
# - Another GPU (H100): the GPU tests of what sessions 37-38 changed, and the engine paths they touch.
set -u
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "GPU: $gpu"
if echo "$gpu" | grep -q H200; then
  bash benchmarks/results/session38/h200_one_call.sh
  tests_timeout=120
else
  tests_timeout=420
fi
GPU_TESTS_TIMEOUT=$tests_timeout GPU_TESTS_PATHS="tests/test_preload_bounds.py tests/test_overlap_gpu.py \
tests/test_prompt_logprobs_gpu.py tests/test_nan_logits_gpu.py tests/server" \
  bash benchmarks/run_device_suite.sh "$OUT" gpu-tests 2>&1 | grep -v "^  skip" | tail -30
ls "$OUT"
