#!/bin/bash
# build.sh OLD_CSRC NEW_CSRC OUTDIR: the A/B harness, AVX-512 (ab512) and AVX2 (ab256) builds.
set -e
old=$1; new=$2; out=$3; here=$(dirname "$0")
mkdir -p "$out"
F512="-mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx512bf16 -mavx512vbmi"
F256="-mavx2 -mfma -mf16c"
for isa in 512 256; do
  fl=F$isa
  g++ -O3 -std=c++17 -fno-strict-aliasing -Wno-uninitialized -Wno-maybe-uninitialized ${!fl} -DISA512=$([ $isa = 512 ] && echo 1 || echo 0) -DTAG=a -I"$old" -c "$here/kern.cpp" -o "$out/ka$isa.o" &
  g++ -O3 -std=c++17 -fno-strict-aliasing -Wno-uninitialized -Wno-maybe-uninitialized ${!fl} -DISA512=$([ $isa = 512 ] && echo 1 || echo 0) -DTAG=b -I"$new" -c "$here/kern.cpp" -o "$out/kb$isa.o" &
  wait
  g++ -O2 -std=c++17 -mavx2 -mf16c -c "$here/main.cpp" -o "$out/main.o"
  g++ "$out/main.o" "$out/ka$isa.o" "$out/kb$isa.o" -o "$out/ab$isa"
done
