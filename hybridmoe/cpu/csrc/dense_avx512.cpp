// Dense BF16 rows, AVX-512 + AVX512-BF16 (dense.h): vdpbf16ps multiplies 32 bf16 weights by 32
// bf16 activations and adds the pair sums into 16 fp32 lanes, so weights and activations are used
// as stored (adjacent K values pair up in both). The K tail is a masked (zero-filled) load.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "dense.h"

namespace hm {
namespace {

constexpr int kRows = 4;
constexpr int kTT = kDenseTokTile;

template <int R, int TT>
void block(const HmDenseTask& t, int n, int64_t tok0, int pf) {
  const uint16_t* w[R];
  const uint16_t* x[TT];
  for (int r = 0; r < R; ++r) w[r] = t.w + int64_t(n + r) * t.ldw;
  for (int j = 0; j < TT; ++j) x[j] = t.x + (tok0 + j) * t.ldx;
  __m512 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < TT; ++j) acc[r][j] = _mm512_setzero_ps();
  const int K = t.K;
  const int64_t ahead = prefetch_ahead(t, R, pf);
  int k = 0;
  for (; k + 32 <= K; k += 32) {
    if (pf)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w[r] + k + ahead), _MM_HINT_T0);
    __m512i xv[TT];
    for (int j = 0; j < TT; ++j) xv[j] = _mm512_loadu_si512(x[j] + k);
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_loadu_si512(w[r] + k);
      for (int j = 0; j < TT; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)wv, (__m512bh)xv[j]);
    }
  }
  if (k < K) {
    const __mmask32 m = __mmask32((1ull << (K - k)) - 1);
    __m512i xv[TT];
    for (int j = 0; j < TT; ++j) xv[j] = _mm512_maskz_loadu_epi16(m, x[j] + k);
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_maskz_loadu_epi16(m, w[r] + k);
      for (int j = 0; j < TT; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)wv, (__m512bh)xv[j]);
    }
  }
  for (int j = 0; j < TT; ++j)
    for (int r = 0; r < R; ++r) dense_store(t, tok0 + j, n + r, _mm512_reduce_add_ps(acc[r][j]));
}

// One row for one token (decode): row1's callers walk a chunk's rows one after another, one linear stream
// through the weights (four rows at a time are four interleaved streams, which DRAM serves slower: the
// lm_head of a 2-core Zen 4 CPU-only decode ran at 56% of the stream bandwidth that way). Four dot chains
// over K, so the row's dots do not wait on one another's latency. PF: the software prefetch as a template
// argument, so the loop without it carries no prefetch pointer or test (with them, the one-thread GEMV
// on Zen 4 read 15% slower: 27.7 against 32.0 GB/s, same harness).
template <bool PF>
void row1_(const HmDenseTask& t, int n, int pf) {
  const uint16_t* w = t.w + int64_t(n) * t.ldw;
  const uint16_t* x = t.x;
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const int K = t.K;
  const int64_t ahead = pf / 2;  // elements
  int k = 0;
  for (; k + 128 <= K; k += 128) {
    if (PF)
      for (int l = 0; l < 128; l += 32) _mm_prefetch(reinterpret_cast<const char*>(w + k + l + ahead), _MM_HINT_T0);
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + k + 32), (__m512bh)_mm512_loadu_si512(x + k + 32));
    a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w + k + 64), (__m512bh)_mm512_loadu_si512(x + k + 64));
    a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w + k + 96), (__m512bh)_mm512_loadu_si512(x + k + 96));
  }
  for (; k + 32 <= K; k += 32)
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
  if (k < K) {
    const __mmask32 m = __mmask32((1ull << (K - k)) - 1);
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_maskz_loadu_epi16(m, w + k), (__m512bh)_mm512_maskz_loadu_epi16(m, x + k));
  }
  dense_store(t, 0, n, _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))));
}

#include "dense_rows.h"

}  // namespace
}  // namespace hm

extern "C" hm::DenseRowsFn hm_dense_rows_avx512() { return &hm::rows; }
