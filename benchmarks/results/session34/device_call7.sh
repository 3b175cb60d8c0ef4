#!/usr/bin/env bash
# session 34 call 7 (warm, same host as call 6): issue 16 points 1-3 on this commit: hybrid d0 / d2 batch 1 x3
# interleaved (prefetch default now 4096 on Intel), then the CPU MoE op AMXINT4 / AMXINT8 at T 1024, 4096.
export PYTHONPATH=$PWD HYBRIDMOE_AMX_EMULATE=0 PYTHONUNBUFFERED=1 HYBRIDMOE_CPU_LIB=/tmp/lib.so
[ -f /tmp/lib.so ] || python3 benchmarks/results/session34/build_lib.py hybridmoe/cpu/csrc /tmp/lib.so
timeout 110 python3 benchmarks/bench_hybrid_decode.py --deferred 0 2 --batch 1 --graphs on --steps 160 --repeat 3 \
  --out "$OUT/hybrid_decode.json" 2>&1 | grep -v Warning | grep -E "median|best probe|Error|error|Traceback" | head -8
timeout 60 python3 benchmarks/bench_cpu_moe.py --method AMXINT4,AMXINT8 --T 1024,4096 --seconds 0.5 \
  --out "$OUT/cpu_moe_int4_int8.json" 2>&1 | grep -E "^ +AMXINT|best stream"
echo "== end $(date +%T)"
