#!/usr/bin/env bash
# Builds and runs bench_fp8_rows.cpp. A = moe_avx512.cpp at git ref $1 (default HEAD; or the path of a
# variant of the source), B = the working copy (with moe_amx.cpp: an FP8-Bamx column where the CPU has
# AMX), compiled with build.py's flags. Further arguments go to the benchmark: experts rounds prefetch
# threads. Examples (Zen 4 dev box; the H200 host: more experts than its LLC, 15 threads; a copy of
# the tree without git history takes A as a file, extracted beforehand with git show):
#   bash benchmarks/fp8_rows/run.sh ad61aa4 6 15 2048 1
#   git show ad61aa4:hybridmoe/cpu/csrc/moe_avx512.cpp > benchmarks/fp8_rows/moe_avx512_ad61aa4.cpp
#   bash benchmarks/fp8_rows/run.sh benchmarks/fp8_rows/moe_avx512_ad61aa4.cpp 96 9 2048 15
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../.." && pwd); csrc=$root/hybridmoe/cpu/csrc
ref=${1:-HEAD}; shift || true
out=$(mktemp -d /tmp/fp8_rows.XXXXXX)
base="-O3 -std=c++17 -fPIC -w -fno-strict-aliasing -pthread ${HYBRIDMOE_CXXFLAGS:-}"
avx512="-mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx512bf16 -mavx512vbmi"
if [ -f "$ref" ]; then cp "$ref" "$out/moe_a.cpp"; else git -C "$root" show "$ref:hybridmoe/cpu/csrc/moe_avx512.cpp" > "$out/moe_a.cpp"; fi
cat >> "$out/moe_a.cpp" <<'CPP'
extern "C" void gemm_a(int method, const void* W, int e, const void* A, int M, int nb0, int nb1, float* C,
                       int64_t ldc, int G) {
  hm::avx512::gemm(method, *static_cast<const hm::PackedMat*>(W), e, *static_cast<const hm::ActView*>(A), M, nb0,
                   nb1, C, ldc, G);
}
extern "C" void fp8_to_bf16_a(const uint8_t* src, uint16_t* dst, int64_t steps) {
  hm::avx512::fp8_to_bf16(src, dst, steps);
}
CPP
g++ $base $avx512 -I"$csrc" -Dhm=hm_a -Dhm_kernels_avx512=hm_kernels_avx512_a -c "$out/moe_a.cpp" -o "$out/a.o"
g++ $base $avx512 -I"$csrc" -c "$csrc/moe_avx512.cpp" -o "$out/b.o"
objs="$out/a.o $out/b.o"
if g++ $base $avx512 -mamx-tile -mamx-int8 -mamx-bf16 -I"$csrc" -c "$csrc/moe_amx.cpp" -o "$out/amx.o" 2>/dev/null; then
  objs="$objs $out/amx.o"
fi
g++ $base -I"$csrc" -c "$csrc/dispatch.cpp" -o "$out/dispatch.o"
g++ $base $avx512 -I"$csrc" "$here/bench_fp8_rows.cpp" $objs "$out/dispatch.o" -o "$out/bench"
echo "# A = $ref ($( [ -f "$ref" ] && echo file || git -C "$root" rev-parse --short "$ref")), B = working copy; binary $out/bench"
"$out/bench" "$@"
