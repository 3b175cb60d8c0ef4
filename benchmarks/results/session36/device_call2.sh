#!/usr/bin/env bash
# session 36 call 2: the GPU tests of what sessions 35-36 changed on the GPU path (LoRA slots, RoPE tables cut
# to the context length: parity, graphs, hybrid, DeepSeek), then the MLA tile sweep with every default tile
# (which tile is best at batch 1 and 4, where the kernel is not tensor-core bound). Carry .whl.
export TRITON_DEFAULT_FP_FUSION=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline | head -1
GPU_TESTS_TIMEOUT=${GPU_TESTS_TIMEOUT:-300} GPU_TESTS_PATHS="tests/lora tests/test_parity.py tests/cpu/test_hybrid.py tests/test_prefill_graph_gpu.py tests/test_deepseek.py tests/test_startup_checks_api.py" \
  bash benchmarks/run_device_suite.sh "$OUT" gpu-tests 2>&1 | grep -v "^  skip" | tail -30
echo "== MLA sweep $(date +%T)"
timeout ${SWEEP_TIMEOUT:-60} python3 benchmarks/bench_mla_decode.py --sweep --out $OUT/mla_sweep_all.json 2>&1 | grep -v -i warn | tail -110
echo "== end $(date +%T)"
