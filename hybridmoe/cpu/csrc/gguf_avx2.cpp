// GGUF block kernels, AVX2 (+FMA, F16C): per 32 values maddubs (u8 x s8 -> int16 pairs; unsigned
// types stay below 64 so pairs cannot saturate) and madd with ones give 8 int32 sums of 4 products,
// converted and scaled per lane; signed types (Q8_0, IQ4_XS) use the sign trick |w| x sign(a, w).
// MR activation rows share each weight register. Every symbol has internal linkage.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

#include "gguf_common.h"

namespace hm {
namespace {

constexpr bool kVnni = false;
constexpr int MR = 4;  // activation rows per register block

#include "gguf_unpack.h"

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#include "gguf_dot256.h"

template <int R, bool SGN>
void dot(const UBlk* U, int B, const ActView& A, int K, int m0, float* out, int64_t ldc) {
  const int8_t* q[R];
  const float *bs[R], *dd[R];
  for (int t = 0; t < R; ++t) {
    const uint8_t* row = A.data + (m0 + t) * A.ld;
    q[t] = reinterpret_cast<const int8_t*>(row);
    bs[t] = reinterpret_cast<const float*>(row + K);
    dd[t] = bs[t] + K / 16;
  }
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm256_setzero_ps();
  for (int b = 0; b < B; ++b) {
    const UBlk& u = U[b];
    const __m256 b0 = _mm256_load_ps(u.bias), b1 = _mm256_load_ps(u.bias + 8);
    __m256 blk[R];
    for (int t = 0; t < R; ++t)
      blk[t] = _mm256_fmadd_ps(b1, _mm256_loadu_ps(bs[t] + b * 16 + 8), _mm256_mul_ps(b0, _mm256_loadu_ps(bs[t] + b * 16)));
    for (int c = 0; c < 8; ++c) {
      const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(u.u + 32 * c));
      const __m256 sl = _mm256_load_ps(u.sl + 8 * c);
      const __m256i wa = SGN ? _mm256_sign_epi8(w, w) : w;
      for (int t = 0; t < R; ++t) {
        __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[t] + b * 256 + 32 * c));
        if (SGN) a = _mm256_sign_epi8(a, w);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, a), ones);
        blk[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sl, blk[t]);
      }
    }
    for (int t = 0; t < R; ++t) acc[t] = _mm256_fmadd_ps(blk[t], _mm256_set1_ps(dd[t][b]), acc[t]);
  }
  for (int t = 0; t < R; ++t) out[t * ldc] = hsum8(acc[t]);
}

template <bool SGN>
void dot_sel(const UBlk* U, int B, const ActView& A, int K, int m0, int mr, float* out, int64_t ldc) {
  switch (mr) {
    case 4: return dot<4, SGN>(U, B, A, K, m0, out, ldc);
    case 3: return dot<3, SGN>(U, B, A, K, m0, out, ldc);
    case 2: return dot<2, SGN>(U, B, A, K, m0, out, ldc);
    default: return dot<1, SGN>(U, B, A, K, m0, out, ldc);
  }
}

void dot_rows(const UBlk* U, int B, const ActView& A, int K, int m0, int mr, bool sgn, float* out, int64_t ldc) {
  if (sgn)
    dot_sel<true>(U, B, A, K, m0, mr, out, ldc);
  else
    dot_sel<false>(U, B, A, K, m0, mr, out, ldc);
}

#include "gguf_gemm.h"

const Kernels kTable = {"gguf-avx2", act_row_bytes, quant_row, gemm, quant_block};

}  // namespace
}  // namespace hm

extern "C" const hm::Kernels* hm_kernels_gguf_avx2() { return &hm::kTable; }
