// Dense BF16 rows, AVX2 + FMA (dense.h): 8 bf16 weights widened to fp32 by a 16-bit shift (exact),
// the activations likewise, then FMA into fp32 lanes; the K tail (K % 8) is a scalar loop.
#include <immintrin.h>

#include <cstring>

#include "dense.h"

namespace hm {
namespace {

constexpr int kRows = 4;
constexpr int kTT = 2;  // 4 rows x 2 tokens = 8 accumulators: with weights and x, within 16 ymm

inline __m256 widen8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float widen1(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int R, int TT>
void block(const HmDenseTask& t, int n, int64_t tok0, int pf) {
  const uint16_t* w[R];
  const uint16_t* x[TT];
  for (int r = 0; r < R; ++r) w[r] = t.w + int64_t(n + r) * t.ldw;
  for (int j = 0; j < TT; ++j) x[j] = t.x + (tok0 + j) * t.ldx;
  __m256 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < TT; ++j) acc[r][j] = _mm256_setzero_ps();
  const int K = t.K;
  const int64_t ahead = prefetch_ahead(t, R, pf);
  int k = 0;
  for (; k + 8 <= K; k += 8) {
    if (pf && (k & 31) == 0)  // one prefetch per 64-byte line of each row
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w[r] + k + ahead), _MM_HINT_T0);
    __m256 xv[TT];
    for (int j = 0; j < TT; ++j) xv[j] = widen8(x[j] + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = widen8(w[r] + k);
      for (int j = 0; j < TT; ++j) acc[r][j] = _mm256_fmadd_ps(wv, xv[j], acc[r][j]);
    }
  }
  for (int j = 0; j < TT; ++j)
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[r][j]);
      for (int kk = k; kk < K; ++kk) s += widen1(w[r][kk]) * widen1(x[j][kk]);
      dense_store(t, tok0 + j, n + r, s);
    }
}

// One row for one token (decode): see dense_avx512.cpp's row1_ (one linear stream, four dot chains, PF a
// template argument).
template <bool PF>
void row1_(const HmDenseTask& t, int n, int pf) {
  const uint16_t* w = t.w + int64_t(n) * t.ldw;
  const uint16_t* x = t.x;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const int K = t.K;
  const int64_t ahead = pf / 2;  // elements
  int k = 0;
  for (; k + 32 <= K; k += 32) {
    if (PF) _mm_prefetch(reinterpret_cast<const char*>(w + k + ahead), _MM_HINT_T0);
    a0 = _mm256_fmadd_ps(widen8(w + k), widen8(x + k), a0);
    a1 = _mm256_fmadd_ps(widen8(w + k + 8), widen8(x + k + 8), a1);
    a2 = _mm256_fmadd_ps(widen8(w + k + 16), widen8(x + k + 16), a2);
    a3 = _mm256_fmadd_ps(widen8(w + k + 24), widen8(x + k + 24), a3);
  }
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(widen8(w + k), widen8(x + k), a0);
  float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; k < K; ++k) s += widen1(w[k]) * widen1(x[k]);
  dense_store(t, 0, n, s);
}

#include "dense_rows.h"

}  // namespace
}  // namespace hm

extern "C" hm::DenseRowsFn hm_dense_rows_avx2() { return &hm::rows; }
