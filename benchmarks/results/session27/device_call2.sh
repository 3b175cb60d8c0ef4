#!/usr/bin/env bash
# session 27 call 2: GPU tests of the session's changes (router count fold, decode graphs' shared logits, MLA merge,
# DIRECT inter-row zeros, LoRA), the MLA split/merge probe, the batch-1 profile and A/B
nvidia-smi --query-gpu=name --format=csv,noheader
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1
export PYTHONPATH=/tmp/site
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_router_triton.py tests/test_recorder_kernel.py \
  tests/test_parity.py tests/test_overlap_gpu.py tests/test_prefill_graph_gpu.py tests/test_nan_logits_gpu.py \
  tests/test_mla_triton_gpu.py tests/test_triton_moe.py tests/lora/test_lora_gpu.py tests/cpu/test_hybrid.py \
  tests/gguf/test_gguf_hybrid_cuda.py -rf 2>&1 > "$OUT/gpu_tests_call2.log"
grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests_call2.log" | tail -12
timeout 120 python3 benchmarks/results/session27/mla_split_probe.py "$OUT/mla_split_probe.json" 2>&1 | grep -v Warn | tail -80
timeout 80 python3 benchmarks/ab_decode_kernels.py --rounds 3 --out "$OUT/ab_decode.json" 2>&1 | grep -v Warning | tail -6
timeout 80 python3 benchmarks/profile_decode.py --top 30 2>&1 | grep -v Warning | tail -38 > "$OUT/profile_b1.log"
head -12 "$OUT/profile_b1.log"
