// Dense BF16 linears of the CPU-only model path (attention projections, router, dense MLPs, the LM
// head): out[t][n] = sum_k x[t][k] * w[n][k] (+ bias[n]) with the weights as torch keeps them
// (row-major [N][K] bf16, no repacking) and bf16 activations; fp32 accumulation, fp32 or bf16 out.
// Made for decode-sized T (a few tokens): every weight byte is read once per call, rows split
// across the engine's pool (dense_api.cpp), so the call streams the matrix at the pool's read
// bandwidth. Large T (prefill) is left to torch's GEMM (hybridmoe/cpu/dense.py decides).
//
// Per-ISA kernels (weak, like the MoE tables: a unit the compiler could not build is absent):
//   avx512: vdpbf16ps on 32 K values per instruction (AVX512-BF16); K tail by masked loads.
//   avx2:   bf16 -> fp32 by a 16-bit shift, then FMA on 8 K values; K tail scalar.
#pragma once
#include <cstdint>

extern "C" {
// One dense call (mirrored by hybridmoe/cpu/dense.py DenseTask).
struct HmDenseTask {
  const uint16_t* w;   // bf16 [N][ldw] (unused when q8 is set)
  const uint16_t* x;   // bf16 [T][ldx]
  const float* bias;   // [N] fp32, or nullptr
  void* out;           // [T][ldo], out_dtype (0 fp32, 1 bf16)
  int64_t T, ldw, ldx, ldo;
  int32_t N, K, out_dtype, pad_;
  // INT8 weights instead of w (null: bf16 w): the MoE engine's int8 layout (common.h) of one
  // "expert" of q8_N x q8_Kd (N, K padded to multiples of 64), per-row scales and row sums; the
  // activations are quantized per token as for the int8 experts (dense_api.cpp).
  const uint8_t* q8;
  const float* q8_scale;   // [q8_N]
  const int32_t* q8_wsum;  // [q8_N]
  int32_t q8_N, q8_Kd;
};
}

namespace hm {

// Computes rows [n0, n1) of out for every token of t. prefetch: at least this many bytes ahead, in
// whole row blocks (prefetch_ahead; 0: none).
using DenseRowsFn = void (*)(const HmDenseTask& t, int n0, int n1, int prefetch);

// The tokens one pass over a row block serves (more are done in further passes over the same,
// cache-resident, rows).
constexpr int kDenseTokTile = 4;

// fp32 -> bf16, round to nearest even (NaN kept quiet); the same rounding as torch's.
inline uint16_t dense_f32_to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// Software prefetch distance of a block of R rows, in weight elements: the same K offset whole row
// blocks ahead, at least pf bytes (pf = 0: none). Far prefetches (16-32 KB, the next block of the
// LM head) read at the stream-read rate on the 2-core machine; 0.5-2 KB ahead inside the block
// read 10% slower (benchmarks/bench_cpu_dense.py).
inline int64_t prefetch_ahead(const HmDenseTask& t, int R, int pf) {
  if (pf <= 0) return 0;
  const int64_t block = int64_t(R) * t.ldw;  // elements
  return block * ((int64_t(pf) / 2 + block - 1) / block);
}

inline void dense_store(const HmDenseTask& t, int64_t tok, int n, float v) {
  if (t.bias) v += t.bias[n];
  if (t.out_dtype == 1)
    static_cast<uint16_t*>(t.out)[tok * t.ldo + n] = dense_f32_to_bf16(v);
  else
    static_cast<float*>(t.out)[tok * t.ldo + n] = v;
}

}  // namespace hm

extern "C" hm::DenseRowsFn hm_dense_rows_avx2() __attribute__((weak));
extern "C" hm::DenseRowsFn hm_dense_rows_avx512() __attribute__((weak));
