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

#include "gguf_gemm.h"

const Kernels kTable = {"gguf-avx512", act_row_bytes, quant_row, gemm, quant_block};

}  // namespace
}  // namespace hm

extern "C" const hm::Kernels* hm_kernels_gguf_avx512() { return &hm::kTable; }
