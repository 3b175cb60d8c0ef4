#!/bin/bash
# callgrind.sh BIN TYPE K MR: instructions per weight byte of the two builds' direct kernels
# (direct_a = old sources, direct_b = new) under callgrind; BIN = the AVX2 harness (ab256: valgrind
# decodes no AVX-512). 16 rows in cache, one timing repeat, no check.
set -e
bin=$1; t=$2; K=$3; mr=$4
out=$(mktemp)
valgrind --tool=callgrind --callgrind-out-file="$out" --collect-atstart=no --toggle-collect=direct_a \
  --toggle-collect=direct_b "$bin" "$t" "$K" "$mr" 16 1 cache 0 nocheck >/dev/null 2>&1
python3 - "$out" "$t" "$K" "$mr" <<'PY'
import re, subprocess, sys
out, t, K, mr = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rb = {2: 144, 8: 272, 12: 144, 13: 176, 14: 210, 23: 136}[t] * K // 256
inner = max(1, int(2e6 / (16 * rb)))
ann = subprocess.run(["callgrind_annotate", "--inclusive=yes", out], capture_output=True, text=True).stdout
res = {}
for line in ann.splitlines():
    m = re.match(r"\s*([\d,]+) .*:(direct_[ab]) ", line)
    if m:
        res[m.group(2)] = int(m.group(1).replace(",", "")) / (inner * 16 * rb)
print(f"type={t} K={K} mr={mr}: instr/byte a {res['direct_a']:.4f} b {res['direct_b']:.4f}  b/a {res['direct_b'] / res['direct_a']:.3f}")
PY
rm -f "$out"
