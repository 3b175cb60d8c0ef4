#!/usr/bin/env bash
# session 34 call 6: hybrid decode at batch 1, deferral 0 (the default), with the prefetch distance 2048 (the old Intel
# default) and 4096 (the new one), interleaved, 3 repeats: does the new default move issue 16 point 2's row?
export PYTHONPATH=$PWD HYBRIDMOE_AMX_EMULATE=0 PYTHONUNBUFFERED=1
python3 benchmarks/results/session34/build_lib.py hybridmoe/cpu/csrc /tmp/lib.so; export HYBRIDMOE_CPU_LIB=/tmp/lib.so
echo "== hybrid d0 pf 2048,4096 $(date +%T)"
timeout 250 python3 benchmarks/bench_hybrid_decode.py --deferred 0 --batch 1 --graphs on --steps 160 --prefetch 2048,4096 \
  --repeat 3 --out "$OUT/hybrid_pf.json" 2>&1 | grep -v Warning | grep -E "median|best probe|Error|error|Traceback|tok/s" | head -20
echo "== end $(date +%T)"
