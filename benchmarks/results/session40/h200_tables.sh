#!/usr/bin/env bash
# Session 40 (copy of session38/h200_one_call.sh; GGUF at the host default prefetch distance, 4096 on Intel, not 2048): every issue table but serving in ONE call on an H200 (the ~700 s of budget left could not hold the
# two calls of session34/next_device_call.sh). Exits 3 at once on another GPU (an H100 start costs ~100 s).
# Carry .whl. The logs are removed from OUT at the end (8 files come back: the 7 JSONs).
# Then here: python benchmarks/issue_tables.py <files> --device "H200 host" --commit ...
set -u
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "not an H200: $(nvidia-smi --query-gpu=name --format=csv,noheader)"; exit 3; }
CPU_MOE_ARGS="--T 1,4,16,1024,4096 --seconds 0.3" DECODE_ARGS="--batch 1 64 --graphs on" DECODE_TIMEOUT=90 \
  MLA_TIMEOUT=60 HYBRID_ARGS="--deferred 0 2 --batch 1 4 16 --graphs on --repeat 2 --steps 160" HYBRID_TIMEOUT=200 \
  GGUF_ROUNDS=2 GGUF_PREFETCH=default GGUF_MOE_TIMEOUT=70 GGUF_LARGE_TIMEOUT=75 GGUF_HYBRID_TIMEOUT=1 \
  bash benchmarks/run_device_suite.sh "$OUT" decode cpu-moe mla hybrid gguf 2>&1 | grep -v "^  skip" | tail -80
rm -f "$OUT"/*.log "$OUT"/*.png
ls "$OUT"
