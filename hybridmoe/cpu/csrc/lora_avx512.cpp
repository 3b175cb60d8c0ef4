// The expert LoRA kernels (lora.h LoraKernels) in AVX-512 (F + BW + VL + BF16): 16 fp32 lanes, weights and
// inputs widened from bf16 by a shift, masked loads for the tail of a dot; tiles of up to four rows of
// one (expert, slot), each weight stream read in order (below). Also run on the AMX path.
#include <immintrin.h>

#include <cstdint>

#include "common.h"
#include "lora.h"

// The tiles' loops are unrolled early (pragmas): GCC then keeps the accumulator arrays in registers
// (without, tiles of more than four accumulators were stored to the stack every step).
namespace {

// 16 values from p (fp32, or bf16 widened exactly), lanes >= n zero
inline __m512 load16(const void* p, int dt, int64_t i, int n = 16) {
  const __mmask16 m = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  if (dt == hm::DT_F32) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + i);
  __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline const void* row(const void* base, int dt, int64_t off) {
  return static_cast<const uint8_t*>(base) + off * (dt == hm::DT_F32 ? 4 : 2);
}

// The weights of a task's LoRA units and B blocks are cold (read once per task, from DRAM), and short:
// a unit is 4 rank rows of H values, an item's B range a few 512-byte blocks. Both kernels read them
// as one sequential stream (a rank row after the other; a block's R x 16 values after the other):
// reading several rows or blocks side by side, a few lines of each at a time, left the hardware
// prefetchers untrained and ran at about half the stream rate of one core (cold-buffer micro-benchmark
// on Zen 4: dot 17 -> 24 GB/s at H = 2048 and 11 -> 22 at 768, axpy 9 -> 23, against a 21 GB/s read).
// x (a few KB) and the rank vector stay in L1 and are reloaded per rank or block.

// MM rows x one rank, CH chains over the row of A: MM * CH independent accumulators.
template <int MM, int CH>
inline void dot_rank(const void* a, int wdt, const void* const* x, int xdt, int n, float s, float* out,
                     int64_t ldo) {
  __m512 c[CH][MM];
  #pragma GCC unroll 16
  for (int q = 0; q < CH; ++q)
    #pragma GCC unroll 16
    for (int m = 0; m < MM; ++m) c[q][m] = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16 * CH)
    #pragma GCC unroll 16
    for (int q = 0; q < CH; ++q) {
      const int j = i + 16 * q, left = n - j;  // left <= 0: an empty mask, nothing read
      const __m512 av = load16(a, wdt, j, left < 0 ? 0 : left);
      #pragma GCC unroll 16
      for (int m = 0; m < MM; ++m) c[q][m] = _mm512_fmadd_ps(av, load16(x[m], xdt, j, left < 0 ? 0 : left), c[q][m]);
    }
  #pragma GCC unroll 16
  for (int m = 0; m < MM; ++m) {
    __m512 v = c[0][m];
    #pragma GCC unroll 16
    for (int q = 1; q < CH; ++q) v = _mm512_add_ps(v, c[q][m]);
    out[m * ldo] = s * _mm512_reduce_add_ps(v);
  }
}

// 32 bf16 values from p + i, lanes >= left zero
inline __m512bh load32bh(const void* p, int64_t i, int left) {
  const __mmask32 m = left >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << left) - 1);
  return (__m512bh)_mm512_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i);
}

// dot_rank for bf16 weights and bf16 x (a bf16 model's gate/up input): vdpbf16ps takes the pairs as
// they are (exact products, fp32 sums; the AVX-512 path requires avx512_bf16, dispatch.cpp), no
// widening: half the instructions per product.
template <int MM, int CH>
inline void dot_rank_bf16(const void* a, const void* const* x, int n, float s, float* out, int64_t ldo) {
  __m512 c[CH][MM];
  #pragma GCC unroll 16
  for (int q = 0; q < CH; ++q)
    #pragma GCC unroll 16
    for (int m = 0; m < MM; ++m) c[q][m] = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 32 * CH)
    #pragma GCC unroll 16
    for (int q = 0; q < CH; ++q) {
      const int j = i + 32 * q, left = n - j < 0 ? 0 : n - j;
      const __m512bh av = load32bh(a, j, left);
      #pragma GCC unroll 16
      for (int m = 0; m < MM; ++m) c[q][m] = _mm512_dpbf16_ps(c[q][m], av, load32bh(x[m], j, left));
    }
  #pragma GCC unroll 16
  for (int m = 0; m < MM; ++m) {
    __m512 v = c[0][m];
    #pragma GCC unroll 16
    for (int q = 1; q < CH; ++q) v = _mm512_add_ps(v, c[q][m]);
    out[m * ldo] = s * _mm512_reduce_add_ps(v);
  }
}

template <int MM>
void dot_m(const void* A, int wdt, int64_t lda, int rows, const void* const* x, int xdt, int n, float s, float* out,
           int64_t ldo) {
  constexpr int CH = MM == 1 ? 4 : MM == 2 ? 2 : 1;  // >= 4 chains with the loads of a step in flight
  const bool bf = wdt == hm::DT_BF16 && xdt == hm::DT_BF16;
  for (int k = 0; k < rows; ++k) {
    const void* a = row(A, wdt, k * lda);
    if (bf)
      dot_rank_bf16<MM, CH>(a, x, n, s, out + k, ldo);
    else
      dot_rank<MM, CH>(a, wdt, x, xdt, n, s, out + k, ldo);
  }
}

void dot(const void* A, int wdt, int64_t lda, int rows, const void* const* x, int xdt, int M, int n, float s,
         float* out, int64_t ldo) {
  switch (M) {
    case 1: return dot_m<1>(A, wdt, lda, rows, x, xdt, n, s, out, ldo);
    case 2: return dot_m<2>(A, wdt, lda, rows, x, xdt, n, s, out, ldo);
    case 3: return dot_m<3>(A, wdt, lda, rows, x, xdt, n, s, out, ldo);
    default: return dot_m<4>(A, wdt, lda, rows, x, xdt, n, s, out, ldo);
  }
}

// One 16-column block for MM rows, its R x 16 values in order (rank k's 16 at k * ldb), the rank sum
// split KS ways: MM * KS independent FMA chains, each B load serving MM rows.
template <int MM, int KS>
inline void axpy_block(const void* Bt, int wdt, int64_t ldb, int rows, const float* a, int64_t lda, float* C,
                       int64_t ldc) {
  __m512 acc[KS][MM];
  #pragma GCC unroll 16
  for (int m = 0; m < MM; ++m) {
    acc[0][m] = _mm512_loadu_ps(C + m * ldc);
    #pragma GCC unroll 16
    for (int q = 1; q < KS; ++q) acc[q][m] = _mm512_setzero_ps();
  }
  int k = 0;
  for (; k + KS <= rows; k += KS)
    #pragma GCC unroll 16
    for (int q = 0; q < KS; ++q) {
      const __m512 bv = load16(Bt, wdt, (k + q) * ldb);
      #pragma GCC unroll 16
      for (int m = 0; m < MM; ++m) acc[q][m] = _mm512_fmadd_ps(_mm512_set1_ps(a[m * lda + k + q]), bv, acc[q][m]);
    }
  for (; k < rows; ++k) {
    const __m512 bv = load16(Bt, wdt, k * ldb);
    #pragma GCC unroll 16
    for (int m = 0; m < MM; ++m) acc[0][m] = _mm512_fmadd_ps(_mm512_set1_ps(a[m * lda + k]), bv, acc[0][m]);
  }
  #pragma GCC unroll 16
  for (int m = 0; m < MM; ++m) {
    __m512 v = acc[0][m];
    #pragma GCC unroll 16
    for (int q = 1; q < KS; ++q) v = _mm512_add_ps(v, acc[q][m]);
    _mm512_storeu_ps(C + m * ldc, v);
  }
}

template <int MM>
void axpy_m(const void* Bt, int wdt, int64_t ldb, int rows, const float* a, int64_t lda, int nblk, int64_t bstep,
            float* C, int64_t ldc, int64_t cstep) {
  constexpr int KS = MM <= 2 ? 4 : 2;
  for (int b = 0; b < nblk; ++b)
    axpy_block<MM, KS>(row(Bt, wdt, b * bstep), wdt, ldb, rows, a, lda, C + b * cstep, ldc);
}

void axpy(const void* Bt, int wdt, int64_t ldb, int rows, const float* a, int64_t lda, int M, int nblk,
          int64_t bstep, float* C, int64_t ldc, int64_t cstep) {
  switch (M) {
    case 1: return axpy_m<1>(Bt, wdt, ldb, rows, a, lda, nblk, bstep, C, ldc, cstep);
    case 2: return axpy_m<2>(Bt, wdt, ldb, rows, a, lda, nblk, bstep, C, ldc, cstep);
    case 3: return axpy_m<3>(Bt, wdt, ldb, rows, a, lda, nblk, bstep, C, ldc, cstep);
    default: return axpy_m<4>(Bt, wdt, ldb, rows, a, lda, nblk, bstep, C, ldc, cstep);
  }
}

const hm::LoraKernels kLora = {dot, axpy};

}  // namespace

extern "C" const hm::LoraKernels* hm_lora_kernels_avx512() { return &kLora; }
