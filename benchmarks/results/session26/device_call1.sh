#!/usr/bin/env bash
# session 26 call 1: the whole GPU suite (session 25's unrun tests: prefill graphs default-on, recorder mask,
# parity deepseek fix, expert-distribution GPU test)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
GPU_TESTS_TIMEOUT=510 bash benchmarks/run_device_suite.sh "$OUT" gpu-tests
grep -E "FAILED|ERROR" "$OUT/gpu_tests.log" | head -20
tail -3 "$OUT/gpu_tests.log"
