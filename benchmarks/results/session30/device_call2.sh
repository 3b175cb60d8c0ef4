#!/usr/bin/env bash
# session 30 call 2: the stream's wait for a CPU task by memory operations (cuStreamWaitValue32 on a done word the
# pool sets) against the host function: the GPU test first (tokens equal for both waits, graphs on and off), then
# the hybrid decode A/B at deferral 0 and 2, interleaved, 3 repeats (~6 min with the build)
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1; export PYTHONPATH=/tmp/site
lscpu | grep -E "Model name" | head -1; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== gpu test $(date +%T)"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/cpu/test_hybrid.py -k "stream_path_on_cuda" -x 2>&1 | tail -5
echo "== hybrid: hostfn / memop at d0 / d2 $(date +%T)"
timeout 360 python3 benchmarks/bench_hybrid_decode.py --deferred 0 2 --batch 1 --graphs on --repeat 3 \
  --stream-wait hostfn,memop --out "$OUT/hybrid_wait.json" 2>&1 | grep -v Warning | grep -E "median|best probe|CPU trace|Error|error" | head -40
