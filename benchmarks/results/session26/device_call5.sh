#!/usr/bin/env bash
# session 26 call 5: the one-token router in one launch + the one-token MoE form, A/B in one process; GPU tests
nvidia-smi --query-gpu=name --format=csv,noheader
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1
export PYTHONPATH=/tmp/site
timeout 110 python3 benchmarks/ab_decode_kernels.py --rounds 3 --out "$OUT/ab_decode_router.json" 2>&1 | grep -v Warning | tail -10
timeout 220 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_router_triton.py tests/test_nan_logits_gpu.py \
  tests/test_parity.py tests/cpu/test_hybrid.py tests/test_overlap_gpu.py tests/test_prefill_graph_gpu.py \
  tests/gguf/test_gguf_hybrid_cuda.py tests/lora/test_lora_gpu.py tests/test_recorder_kernel.py -rf 2>&1 \
  > "$OUT/gpu_tests_call5.log"; grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests_call5.log" | tail -15
grep -cE "PASSED" "$OUT/gpu_tests_call5.log"; tail -2 "$OUT/gpu_tests_call5.log"
