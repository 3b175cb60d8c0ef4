#!/usr/bin/env bash
# session 27 call 4: hybrid decode, deferral 0 and 2, batch 1, 3 interleaved repeats (48 layers, 32 GPU experts, AMXINT8)
# on this session's HEAD (the router launch counts the experts: one GPU launch less between router and CPU task)
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1; export PYTHONPATH=/tmp/site
timeout 400 python3 benchmarks/bench_hybrid_decode.py --deferred 0 2 --batch 1 --graphs on --repeat 3 --out "$OUT/hybrid_defer.json" 2>&1 | grep -v Warning | tail -30
