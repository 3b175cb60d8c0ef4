// GGUF block kernels, AVX-512 (F/BW/VL + VNNI): per 64 values one dpbusd (u8 weights from the
// unpacked tile x s8 activations) gives 16 int32 sums of 4 products, converted and scaled per lane
// (sl), plus the group bias times the activation group sums; MR activation rows share each weight
// register. Every symbol has internal linkage (see moe_avx512.cpp on template instances).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

#include "gguf_common.h"

namespace hm {
namespace {

constexpr bool kVnni = true;
constexpr int MR = 8;  // activation rows per register block

#include "gguf_unpack.h"
#include "gguf_dot512.h"

template <int R>
void dot(const UBlk* U, int B, const ActView& A, int K, int m0, float* out, int64_t ldc) {
  const int8_t* q[R];
  const float *bs[R], *dd[R];
  for (int t = 0; t < R; ++t) {
    const uint8_t* row = A.data + (m0 + t) * A.ld;
    q[t] = reinterpret_cast<const int8_t*>(row);
    bs[t] = reinterpret_cast<const float*>(row + K);
    dd[t] = bs[t] + K / 16;
  }
  __m512 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm512_setzero_ps();
  for (int b = 0; b < B; ++b) {
    const UBlk& u = U[b];
    const __m512 bias = _mm512_load_ps(u.bias);
    __m512 blk[R];
    for (int t = 0; t < R; ++t) blk[t] = _mm512_mul_ps(bias, _mm512_loadu_ps(bs[t] + b * 16));
    for (int c = 0; c < 4; ++c) {
      const __m512i w = _mm512_load_si512(u.u + 64 * c);
      const __m512 sl = _mm512_load_ps(u.sl + 16 * c);
      for (int t = 0; t < R; ++t) {
        const __m512i a = _mm512_loadu_si512(q[t] + b * 256 + 64 * c);
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a);
        blk[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sl, blk[t]);
      }
    }
    for (int t = 0; t < R; ++t) acc[t] = _mm512_fmadd_ps(blk[t], _mm512_set1_ps(dd[t][b]), acc[t]);
  }
  for (int t = 0; t < R; ++t) out[t * ldc] = _mm512_reduce_add_ps(acc[t]);
}

void dot_rows(const UBlk* U, int B, const ActView& A, int K, int m0, int mr, bool, float* out, int64_t ldc) {
  switch (mr) {
    case 8: return dot<8>(U, B, A, K, m0, out, ldc);
    case 7: return dot<7>(U, B, A, K, m0, out, ldc);
    case 6: return dot<6>(U, B, A, K, m0, out, ldc);
    case 5: return dot<5>(U, B, A, K, m0, out, ldc);
    case 4: return dot<4>(U, B, A, K, m0, out, ldc);
    case 3: return dot<3>(U, B, A, K, m0, out, ldc);
    case 2: return dot<2>(U, B, A, K, m0, out, ldc);
    default: return dot<1>(U, B, A, K, m0, out, ldc);
  }
}

// Large T (more than kGgufDirectRows rows an expert), the step-layout tile: each unpacked super-block of
// an N-block's 16 rows is transposed so that one register holds values 4s..4s+3 of all 16 rows (as the
// AMXINT8 packing); one dpbusd then gives 64 products of 16 output rows for one activation row (its 4
// values broadcast), and the float work is one conversion and two fmas per 16 (Q6_K) or 32 values and
// activation row, where the row-major `dot` above spends a conversion, an fma and a load per 64 values
// and reduces each output across lanes at the end.
struct alignas(64) VBlk {
  uint8_t w[64][64];   // step s: [16 rows][4 values]
  float s[16][16];     // scale of group g (values 16 g ..) per row
  float bias[16][16];  // bias of group g per row (times the activation group sum)
};

struct VBuf {
  VBlk* p = nullptr;
  int64_t cap = 0;
  ~VBuf() { std::free(p); }
  VBlk* get(int64_t n) {
    if (n > cap) {
      std::free(p);
      p = static_cast<VBlk*>(std::aligned_alloc(64, size_t(n) * sizeof(VBlk)));
      if (!p) throw std::bad_alloc();
      cap = n;
    }
    return p;
  }
};
thread_local VBuf tl_vbuf;

// U: nrows (<= 16) rows of B unpacked super-blocks, row-major -> V[B]; rows past nrows are zero.
void to_step_layout(const UBlk* U, int B, int nrows, VBlk* V) {
  for (int b = 0; b < B; ++b) {
    VBlk& v = V[b];
    for (int n = 0; n < 16; ++n) {
      if (n < nrows) {
        const UBlk& u = U[n * B + b];
        for (int st = 0; st < 64; ++st) std::memcpy(&v.w[st][4 * n], u.u + 4 * st, 4);
        for (int g = 0; g < 16; ++g) {
          v.s[g][n] = u.sl[4 * g];
          v.bias[g][n] = u.bias[g];
        }
      } else {
        for (int st = 0; st < 64; ++st) std::memset(&v.w[st][4 * n], 0, 4);
        for (int g = 0; g < 16; ++g) v.s[g][n] = v.bias[g][n] = 0.0f;
      }
    }
  }
}

// C[t * ldc + n], n < 16: activation rows m0 .. m0 + R - 1 against the tile. G: values a scale covers
// (32: the two 16-groups of a pair share scale and bias, every type but Q6_K).
template <int R, int G>
void step_dot(const VBlk* V, int B, const ActView& A, int K, int m0, float* C, int64_t ldc) {
  const int8_t* q[R];
  const float *bs[R], *dd[R];
  for (int t = 0; t < R; ++t) {
    const uint8_t* row = A.data + (m0 + t) * A.ld;
    q[t] = reinterpret_cast<const int8_t*>(row);
    bs[t] = reinterpret_cast<const float*>(row + K);
    dd[t] = bs[t] + K / 16;
  }
  __m512 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm512_setzero_ps();
  for (int b = 0; b < B; ++b) {
    const VBlk& v = V[b];
    __m512 blk[R];
    for (int t = 0; t < R; ++t) blk[t] = _mm512_setzero_ps();
    for (int g = 0; g < 16; g += G / 16) {
      __m512i p[R];
      for (int t = 0; t < R; ++t) p[t] = _mm512_setzero_si512();
      for (int st = 4 * g; st < 4 * g + G / 4; ++st) {
        const __m512i w = _mm512_load_si512(v.w[st]);
        for (int t = 0; t < R; ++t) {
          int32_t a;
          std::memcpy(&a, q[t] + b * 256 + 4 * st, 4);
          p[t] = _mm512_dpbusd_epi32(p[t], w, _mm512_set1_epi32(a));
        }
      }
      const __m512 sg = _mm512_load_ps(v.s[g]), bg = _mm512_load_ps(v.bias[g]);
      for (int t = 0; t < R; ++t) {
        const float* gs = bs[t] + b * 16 + g;
        const float sum = G == 32 ? gs[0] + gs[1] : gs[0];
        blk[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[t]), sg, blk[t]);
        blk[t] = _mm512_fmadd_ps(bg, _mm512_set1_ps(sum), blk[t]);
      }
    }
    for (int t = 0; t < R; ++t) acc[t] = _mm512_fmadd_ps(blk[t], _mm512_set1_ps(dd[t][b]), acc[t]);
  }
  for (int t = 0; t < R; ++t) _mm512_storeu_ps(C + t * ldc, acc[t]);
}

template <int G>
void step_rows(const VBlk* V, int B, const ActView& A, int K, int m0, int mr, float* C, int64_t ldc) {
  switch (mr) {
    case 8: return step_dot<8, G>(V, B, A, K, m0, C, ldc);
    case 7: return step_dot<7, G>(V, B, A, K, m0, C, ldc);
    case 6: return step_dot<6, G>(V, B, A, K, m0, C, ldc);
    case 5: return step_dot<5, G>(V, B, A, K, m0, C, ldc);
    case 4: return step_dot<4, G>(V, B, A, K, m0, C, ldc);
    case 3: return step_dot<3, G>(V, B, A, K, m0, C, ldc);
    case 2: return step_dot<2, G>(V, B, A, K, m0, C, ldc);
    default: return step_dot<1, G>(V, B, A, K, m0, C, ldc);
  }
}

// The tile path of gguf_gemm.h for this unit: the N-block's unpacked rows U to the step layout, then
// MR activation rows at a time.
#define HM_GGUF_TILE_ROWS 1
void tile_rows(int type, const UBlk* U, int B, int nrows, const ActView& A, int K, int M, float* Cb, int64_t ldc) {
  VBlk* V = tl_vbuf.get(B);
  to_step_layout(U, B, nrows, V);
  for (int m0 = 0; m0 < M; m0 += MR) {
    const int mr = M - m0 < MR ? M - m0 : MR;
    if (type == GG_Q6_K)
      step_rows<16>(V, B, A, K, m0, mr, Cb + int64_t(m0) * ldc, ldc);
    else
      step_rows<32>(V, B, A, K, m0, mr, Cb + int64_t(m0) * ldc, ldc);
  }
}

#include "gguf_gemm.h"

const Kernels kTable = {"gguf-avx512", act_row_bytes, quant_row, gemm, quant_block};

}  // namespace
}  // namespace hm

extern "C" const hm::Kernels* hm_kernels_gguf_avx512() { return &hm::kTable; }
