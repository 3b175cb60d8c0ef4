set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /tmp/w.log 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . > /tmp/b.log 2>&1 || tail -5 /tmp/b.log
git log --oneline | head -1; git status --short | head -5; nvidia-smi --query-gpu=name --format=csv,noheader; date +%T
echo "== gpu tests"; timeout 220 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_prefill_graph_gpu.py tests/test_overlap_gpu.py tests/test_triton_moe.py -rf --tb=short 2>&1 | tee $OUT/gpu_tests_call2.log | grep -E "^(FAILED|ERROR|E  )|passed|failed" | head -20
echo "== ttft A/B ($(date +%T))"; timeout 220 python3 benchmarks/profile_decode.py --prefill 128 --align-ab --prefill-graph-ab --top 12 2>&1 | grep -v Warning > $OUT/ttft_ab.log; grep -E "prefill|first tokens|per step|GPU op" $OUT/ttft_ab.log | head -12
echo "== serving c=1 ($(date +%T))"; timeout 300 python3 benchmarks/bench_serving.py --dummy-qwen3-30b --server-args "" --concurrency 1 --num-prompts 8 --offline-ceiling --out $OUT/serving.json 2>&1 | grep -v "INFO:" | tail -14
date +%T
set -u
export PYTHONUNBUFFERED=1
date +%T
GPU_TESTS_TIMEOUT=330 bash benchmarks/run_device_suite.sh $OUT gpu-tests 2>&1 | tail -25
export PYTHONPATH=/tmp/site
echo "== amx kernel tests ($(date +%T))"; HYBRIDMOE_CPU_ISA=amx HYBRIDMOE_TEST_THREADS=8 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/cpu/test_cpu_kernels.py tests/cpu/test_cpu_fp8.py tests/cpu/test_gguf_kernels.py --tb=line -rf 2>&1 | tee $OUT/cpu_amx_tests.log | grep -E "^(FAILED|ERROR|E  )|passed|failed" | head -12
date +%T
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /tmp/w.log 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . > /tmp/b.log 2>&1 || tail -5 /tmp/b.log
date +%T
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_parity.py -k "triton" -rf --tb=short 2>&1 | tee $OUT/parity.log | grep -E "^(FAILED|ERROR|E  )|passed|failed" | head -20
date +%T
