#!/usr/bin/env bash
# next session (written in session 34): every table of issues 15, 16 and 18 in two calls on one warm machine (the
# second call skips the native build: run_device_suite.sh's stamp). Carry .whl (benchmarks/fetch_device_wheels.sh)
# for bench_serving. Call 1 (~450 s):
#   CPU_MOE_ARGS="--T 1,4,16,1024,4096 --seconds 0.4" DECODE_ARGS="--batch 1 64 --graphs on" DECODE_TIMEOUT=150 \
#   SERVING_TIMEOUT=200 MLA_TIMEOUT=150 bash benchmarks/run_device_suite.sh "$OUT" decode serving cpu-moe mla
# Call 2 (~450 s; the GGUF hybrid file takes minutes to write, so it is left out):
#   HYBRID_ARGS="--deferred 0 2 --batch 1 4 16 --graphs on --repeat 3" GGUF_ROUNDS=3 GGUF_PREFETCH=4096,2048 \
#   GGUF_LARGE_TIMEOUT=70 GGUF_HYBRID_TIMEOUT=1 bash benchmarks/run_device_suite.sh "$OUT" hybrid gguf
# then here: python benchmarks/issue_tables.py <both calls' files in one folder> --device "..." --commit ...
set -u
part="${1:-1}"
if [ "$part" = 1 ]; then
  CPU_MOE_ARGS="--T 1,4,16,1024,4096 --seconds 0.4" DECODE_ARGS="--batch 1 64 --graphs on" DECODE_TIMEOUT=150 \
    SERVING_TIMEOUT=200 MLA_TIMEOUT=150 bash benchmarks/run_device_suite.sh "$OUT" decode serving cpu-moe mla 2>&1 \
    | grep -v "^  skip" | tail -60
else
  HYBRID_ARGS="--deferred 0 2 --batch 1 4 16 --graphs on --repeat 3" GGUF_ROUNDS=3 GGUF_PREFETCH=4096,2048 \
    GGUF_LARGE_TIMEOUT=70 GGUF_HYBRID_TIMEOUT=1 bash benchmarks/run_device_suite.sh "$OUT" hybrid gguf 2>&1 | tail -60
fi
