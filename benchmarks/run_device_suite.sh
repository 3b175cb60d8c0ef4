#!/usr/bin/env bash
# Everything the H200 machine has to confirm, in few calls (device time is scarce).
# Usage there (OUT is the folder whose files come back):
#   bash benchmarks/run_device_suite.sh "$OUT" [part...]
# Parts (default: all, in this order): check gpu-tests cpu-isa-tests decode hybrid cpu-moe server
# serving. Server tests and bench_serving need fastapi/uvicorn/pydantic wheels carried in .whl (see
# the device README); they run only when `python -c "import fastapi"` works.
set -u
out="${1:-/tmp/hybridmoe-device}"
shift || true
parts="${*:-check gpu-tests cpu-isa-tests decode hybrid cpu-moe server serving}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
log() { echo "== $* ($(date +%T))"; }
want() { [[ " $parts " == *" $1 "* ]]; }
log build
pip install -q --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
if want check; then
  log check
  hybridmoe check > "$out/check.txt" 2>&1; echo "exit $?" >> "$out/check.txt"; cat "$out/check.txt"
fi
if want gpu-tests; then
  log gpu-tests
  timeout "${GPU_TESTS_TIMEOUT:-300}" python -m pytest -q -p no:cacheprovider -m gpu tests -x -rf 2>&1 \
    | tee "$out/gpu_tests.log" | tail -25
fi
if want cpu-isa-tests; then
  log cpu-isa-tests
  for isa in avx2 avx512 amx; do
    HYBRIDMOE_CPU_ISA=$isa HYBRIDMOE_TEST_THREADS=8 timeout 150 python -m pytest -q -p no:cacheprovider tests/cpu \
      2>&1 | tail -2 | sed "s/^/[$isa] /"
  done | tee "$out/cpu_isa_tests.log"
fi
if want decode; then
  log bench-decode
  timeout "${DECODE_TIMEOUT:-300}" python benchmarks/bench_decode.py --steps 48 --out "$out/decode.json" 2>&1 \
    | grep -v Warning | tee "$out/bench_decode.log"
fi
if want hybrid; then
  log bench-hybrid-decode
  timeout "${HYBRID_TIMEOUT:-300}" python benchmarks/bench_hybrid_decode.py ${HYBRID_ARGS:-} --out "$out/hybrid_decode.json" \
    2>&1 | grep -v Warning | tee "$out/bench_hybrid_decode.log"
fi
if want cpu-moe; then
  log bench-cpu-moe
  for m in AMXINT8 AMXINT4; do
    timeout 150 python benchmarks/bench_cpu_moe.py --method $m --out "$out/cpu_moe_$m.json" 2>&1 | tail -16
  done | tee "$out/bench_cpu_moe.log"
fi
if python -c "import fastapi, uvicorn, pydantic" 2>/dev/null; then
  if want server; then
    log server-tests
    timeout 240 python -m pytest -q -p no:cacheprovider tests/server -x 2>&1 | tee "$out/server_tests.log" | tail -5
  fi
  if want serving; then
    log bench-serving
    timeout "${SERVING_TIMEOUT:-300}" python benchmarks/bench_serving.py ${SERVING_ARGS:-} --out "$out/serving.json" 2>&1 \
      | tee "$out/bench_serving.log" | tail -20
  fi
else
  log "no fastapi here: server tests and bench_serving skipped"
fi
log done
