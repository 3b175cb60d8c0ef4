#!/usr/bin/env bash
# Everything the H200 machine has to confirm, in one call (device time is scarce):
#   GPU tests, CPU-engine tests on each ISA, hybridmoe check, decode and CPU-MoE benchmarks.
# Usage there (OUT is the folder whose files come back):  bash benchmarks/run_device_suite.sh "$OUT"
# Server tests and bench_serving need fastapi/uvicorn/pydantic wheels carried in .whl (see the
# device README); they run only when `python -c "import fastapi"` works.
set -u
out="${1:-/tmp/hybridmoe-device}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
log() { echo "== $* ($(date +%T))"; }
log build
pip install -q --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
log check
hybridmoe check > "$out/check.txt" 2>&1; cat "$out/check.txt"
log gpu-tests
timeout 420 python -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$out/gpu_tests.log" | tail -15
log cpu-engine-tests
for isa in avx2 avx512 amx; do
  HYBRIDMOE_CPU_ISA=$isa HYBRIDMOE_TEST_THREADS=8 timeout 120 python -m pytest -q -p no:cacheprovider tests/cpu \
    2>&1 | tail -2 | sed "s/^/[$isa] /"
done | tee "$out/cpu_isa_tests.log"
log bench-decode
timeout 420 python benchmarks/bench_decode.py --steps 48 --out "$out/decode.json" 2>&1 | grep -v Warning \
  | tee "$out/bench_decode.log"
log bench-cpu-moe
for m in AMXINT8 AMXINT4; do
  timeout 150 python benchmarks/bench_cpu_moe.py --method $m --out "$out/cpu_moe_$m.json" 2>&1 | tail -16
done | tee "$out/bench_cpu_moe.log"
log done
