#!/usr/bin/env bash
# session 34 call 3: serving (issue 16 pt 4, fastapi wheels carried) and the GGUF experts (issue 18), one build
SERVING_TIMEOUT=200 GGUF_MOE_TIMEOUT=160 GGUF_PREFETCH=2048,4096 GGUF_ROUNDS=3 GGUF_LARGE_TIMEOUT=70 GGUF_HYBRID_TIMEOUT=1 \
  bash benchmarks/run_device_suite.sh "$OUT" serving gguf 2>&1 | grep -v "^  skip" | tail -45
echo "== end $(date +%T)"
