#!/usr/bin/env bash
# session 31 call 4: bench_decode batch 1 failed after the router change (CUBLAS_STATUS_EXECUTION_FAILED): again with
# the new router config and with the old one (monkeypatched), CUDA_LAUNCH_BLOCKING=1 to name the failing kernel
export PYTHONPATH=$PWD:/tmp/site
for cfg in new old; do
  echo "== $cfg $(date +%T)"
  CUDA_LAUNCH_BLOCKING=1 timeout 110 python3 - "$cfg" <<'PY' 2>&1 | grep -v Warning | grep -E "tok/s|Error|error|File \"/|bound" | head -14
import sys, runpy
sys.path.insert(0, "benchmarks")
if sys.argv[1] == "old":
    import hybridmoe.moe.router_triton as r
    r.CONFIG = (2, 1024, 4)
sys.argv = ["bench_decode.py", "--steps", "48", "--batch", "1"]
runpy.run_path("benchmarks/bench_decode.py", run_name="__main__")
PY
done
