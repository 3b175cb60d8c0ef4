#!/usr/bin/env bash
# session 27 call 3: the GPU tests of the session's changes in two parts, then the MLA acceptance table (checked)
nvidia-smi --query-gpu=name --format=csv,noheader
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1
export PYTHONPATH=/tmp/site
timeout 230 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_router_triton.py tests/test_recorder_kernel.py \
  tests/test_mla_triton_gpu.py tests/test_nan_logits_gpu.py tests/test_prefill_graph_gpu.py tests/test_overlap_gpu.py \
  tests/test_triton_moe.py -rf 2>&1 > "$OUT/gpu_tests_call3a.log"
grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests_call3a.log" | tail -8
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_parity.py tests/lora/test_lora_gpu.py \
  tests/cpu/test_hybrid.py tests/gguf/test_gguf_hybrid_cuda.py -rf 2>&1 > "$OUT/gpu_tests_call3b.log"
grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests_call3b.log" | tail -8
timeout 100 python3 benchmarks/bench_mla_decode.py --check --out "$OUT/mla.json" 2>&1 | grep -v Warn | tail -24
