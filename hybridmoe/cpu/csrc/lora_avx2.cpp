// The expert LoRA kernels (lora.h LoraKernels) in AVX2 + FMA: 8 fp32 lanes, bf16 widened by a
// shift, a scalar tail for a dot whose length is not a multiple of 8; up to four rows of one
// (expert, slot) share each weight load.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "common.h"
#include "lora.h"

// The tiles' loops are unrolled early (pragmas): GCC then keeps the accumulator arrays in registers
// (without, tiles of more than four accumulators were stored to the stack every step).
namespace {

inline __m256 load8(const void* p, int dt, int64_t i) {
  if (dt == hm::DT_F32) return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float load1(const void* p, int dt, int64_t i) {
  if (dt == hm::DT_F32) return static_cast<const float*>(p)[i];
  uint32_t u = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
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

inline const void* row(const void* base, int dt, int64_t off) {
  return static_cast<const uint8_t*>(base) + off * (dt == hm::DT_F32 ? 4 : 2);
}

// Each weight stream read in order, as in lora_avx512.cpp (which says why): a rank row of A after the
// other, a 16-column block's R x 16 values of B after the other; x and the rank vector stay in L1.

// MM rows x one rank, CH chains over the row of A (MM * CH accumulators); the n % 8 tail in scalar.
template <int MM, int CH>
inline void dot_rank(const void* a, int wdt, const void* const* x, int xdt, int n, float s, float* out,
                     int64_t ldo) {
  const int n8 = n / 8 * 8, nc = n8 / (8 * CH) * (8 * CH);
  __m256 c[CH][MM];
  #pragma GCC unroll 16
  for (int q = 0; q < CH; ++q)
    #pragma GCC unroll 16
    for (int m = 0; m < MM; ++m) c[q][m] = _mm256_setzero_ps();
  for (int i = 0; i < nc; i += 8 * CH)
    #pragma GCC unroll 16
    for (int q = 0; q < CH; ++q) {
      const __m256 av = load8(a, wdt, i + 8 * q);
      #pragma GCC unroll 16
      for (int m = 0; m < MM; ++m) c[q][m] = _mm256_fmadd_ps(av, load8(x[m], xdt, i + 8 * q), c[q][m]);
    }
  for (int i = nc; i < n8; i += 8) {
    const __m256 av = load8(a, wdt, i);
    #pragma GCC unroll 16
    for (int m = 0; m < MM; ++m) c[0][m] = _mm256_fmadd_ps(av, load8(x[m], xdt, i), c[0][m]);
  }
  #pragma GCC unroll 16
  for (int m = 0; m < MM; ++m) {
    __m256 v = c[0][m];
    #pragma GCC unroll 16
    for (int q = 1; q < CH; ++q) v = _mm256_add_ps(v, c[q][m]);
    float f = hsum(v);
    for (int i = n8; i < n; ++i) f += load1(a, wdt, i) * load1(x[m], xdt, i);
    out[m * ldo] = s * f;
  }
}

template <int MM>
void dot_m(const void* A, int wdt, int64_t lda, int rows, const void* const* x, int xdt, int n, float s, float* out,
           int64_t ldo) {
  constexpr int CH = MM == 1 ? 4 : 2;  // >= 4 chains
  for (int k = 0; k < rows; ++k) dot_rank<MM, CH>(row(A, wdt, k * lda), wdt, x, xdt, n, s, out + k, ldo);
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

// One 16-column block (two halves) for MM rows, its R x 16 values in order, the rank sum split KS
// ways: MM * 2 * KS independent FMA chains, each B load serving MM rows.
template <int MM, int KS>
inline void axpy_block(const void* Bt, int wdt, int64_t ldb, int rows, const float* a, int64_t lda, float* C,
                       int64_t ldc) {
  __m256 acc[KS][MM][2];
  #pragma GCC unroll 16
  for (int m = 0; m < MM; ++m)
    #pragma GCC unroll 16
    for (int h = 0; h < 2; ++h) {
      acc[0][m][h] = _mm256_loadu_ps(C + m * ldc + 8 * h);
      #pragma GCC unroll 16
      for (int q = 1; q < KS; ++q) acc[q][m][h] = _mm256_setzero_ps();
    }
  int k = 0;
  for (; k + KS <= rows; k += KS)
    #pragma GCC unroll 16
    for (int q = 0; q < KS; ++q) {
      const __m256 b0 = load8(Bt, wdt, (k + q) * ldb), b1 = load8(Bt, wdt, (k + q) * ldb + 8);
      #pragma GCC unroll 16
      for (int m = 0; m < MM; ++m) {
        const __m256 am = _mm256_set1_ps(a[m * lda + k + q]);
        acc[q][m][0] = _mm256_fmadd_ps(am, b0, acc[q][m][0]);
        acc[q][m][1] = _mm256_fmadd_ps(am, b1, acc[q][m][1]);
      }
    }
  for (; k < rows; ++k) {
    const __m256 b0 = load8(Bt, wdt, k * ldb), b1 = load8(Bt, wdt, k * ldb + 8);
    #pragma GCC unroll 16
    for (int m = 0; m < MM; ++m) {
      const __m256 am = _mm256_set1_ps(a[m * lda + k]);
      acc[0][m][0] = _mm256_fmadd_ps(am, b0, acc[0][m][0]);
      acc[0][m][1] = _mm256_fmadd_ps(am, b1, acc[0][m][1]);
    }
  }
  #pragma GCC unroll 16
  for (int m = 0; m < MM; ++m)
    #pragma GCC unroll 16
    for (int h = 0; h < 2; ++h) {
      __m256 v = acc[0][m][h];
      #pragma GCC unroll 16
      for (int q = 1; q < KS; ++q) v = _mm256_add_ps(v, acc[q][m][h]);
      _mm256_storeu_ps(C + m * ldc + 8 * h, v);
    }
}

template <int MM>
void axpy_m(const void* Bt, int wdt, int64_t ldb, int rows, const float* a, int64_t lda, int nblk, int64_t bstep,
            float* C, int64_t ldc, int64_t cstep) {
  constexpr int KS = MM <= 2 ? 2 : 1;  // <= 8 accumulators (16 ymm registers)
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

extern "C" const hm::LoraKernels* hm_lora_kernels_avx2() { return &kLora; }
