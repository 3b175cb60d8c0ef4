// The expert LoRA kernels (lora.h LoraKernels) in AVX2 + FMA: 8 fp32 lanes, bf16 widened by a
// shift, a scalar tail for a dot whose length is not a multiple of 8; tiles of up to four rows of
// one (expert, slot) in registers.
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

// A tile of MM rows x RK ranks (MM * RK accumulators of the 16 ymm registers): each x load serves RK
// ranks, each A load MM rows; the n % 8 tail in scalar.
template <int MM, int RK>
inline void dot_tile(const void* A, int wdt, int64_t lda, int k, const void* const* x, int xdt, int n, float s,
                     float* out, int64_t ldo) {
  const int n8 = n / 8 * 8;
  __m256 c[MM][RK];
  const void* a[RK];
  #pragma GCC unroll 16
  for (int r = 0; r < RK; ++r) a[r] = row(A, wdt, (k + r) * lda);
  #pragma GCC unroll 16
  for (int m = 0; m < MM; ++m)
    #pragma GCC unroll 16
    for (int r = 0; r < RK; ++r) c[m][r] = _mm256_setzero_ps();
  for (int i = 0; i < n8; i += 8) {
    __m256 xv[MM];
    #pragma GCC unroll 16
    for (int m = 0; m < MM; ++m) xv[m] = load8(x[m], xdt, i);
    #pragma GCC unroll 16
    for (int r = 0; r < RK; ++r) {
      const __m256 av = load8(a[r], wdt, i);
      #pragma GCC unroll 16
      for (int m = 0; m < MM; ++m) c[m][r] = _mm256_fmadd_ps(av, xv[m], c[m][r]);
    }
  }
  #pragma GCC unroll 16
  for (int m = 0; m < MM; ++m)
    #pragma GCC unroll 16
    for (int r = 0; r < RK; ++r) {
      float v = hsum(c[m][r]);
      for (int i = n8; i < n; ++i) v += load1(a[r], wdt, i) * load1(x[m], xdt, i);
      out[m * ldo + k + r] = s * v;
    }
}

template <int MM>
void dot_m(const void* A, int wdt, int64_t lda, int rows, const void* const* x, int xdt, int n, float s, float* out,
           int64_t ldo) {
  constexpr int RK = MM <= 2 ? 4 : 2;
  int k = 0;
  for (; k + RK <= rows; k += RK) dot_tile<MM, RK>(A, wdt, lda, k, x, xdt, n, s, out, ldo);
  for (; k < rows; ++k) dot_tile<MM, 1>(A, wdt, lda, k, x, xdt, n, s, out, ldo);
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

// MM rows x NB 16-column blocks (two halves each), the rank sum split KS ways: MM * NB * 2 * KS
// independent FMA chains; each B load serves MM rows.
template <int MM, int NB, int KS>
inline void axpy_tile(const void* Bt, int wdt, int64_t ldb, int rows, const float* a, int64_t lda, int b,
                      int64_t bstep, float* C, int64_t ldc, int64_t cstep) {
  __m256 acc[KS][MM][2 * NB];
  #pragma GCC unroll 16
  for (int m = 0; m < MM; ++m)
    #pragma GCC unroll 16
    for (int j = 0; j < 2 * NB; ++j) {
      acc[0][m][j] = _mm256_loadu_ps(C + m * ldc + (b + j / 2) * cstep + (j % 2) * 8);
      #pragma GCC unroll 16
      for (int q = 1; q < KS; ++q) acc[q][m][j] = _mm256_setzero_ps();
    }
  int k = 0;
  for (; k + KS <= rows; k += KS)
    #pragma GCC unroll 16
    for (int q = 0; q < KS; ++q) {
      const int64_t o = (k + q) * ldb + b * bstep;
      __m256 bv[2 * NB];
      #pragma GCC unroll 16
      for (int j = 0; j < 2 * NB; ++j) bv[j] = load8(Bt, wdt, o + (j / 2) * bstep + (j % 2) * 8);
      #pragma GCC unroll 16
      for (int m = 0; m < MM; ++m) {
        const __m256 am = _mm256_set1_ps(a[m * lda + k + q]);
        #pragma GCC unroll 16
        for (int j = 0; j < 2 * NB; ++j) acc[q][m][j] = _mm256_fmadd_ps(am, bv[j], acc[q][m][j]);
      }
    }
  for (; k < rows; ++k) {
    const int64_t o = k * ldb + b * bstep;
    #pragma GCC unroll 16
    for (int j = 0; j < 2 * NB; ++j) {
      const __m256 bv = load8(Bt, wdt, o + (j / 2) * bstep + (j % 2) * 8);
      #pragma GCC unroll 16
      for (int m = 0; m < MM; ++m) acc[0][m][j] = _mm256_fmadd_ps(_mm256_set1_ps(a[m * lda + k]), bv, acc[0][m][j]);
    }
  }
  #pragma GCC unroll 16
  for (int m = 0; m < MM; ++m)
    #pragma GCC unroll 16
    for (int j = 0; j < 2 * NB; ++j) {
      __m256 v = acc[0][m][j];
      #pragma GCC unroll 16
      for (int q = 1; q < KS; ++q) v = _mm256_add_ps(v, acc[q][m][j]);
      _mm256_storeu_ps(C + m * ldc + (b + j / 2) * cstep + (j % 2) * 8, v);
    }
}

template <int MM>
void axpy_m(const void* Bt, int wdt, int64_t ldb, int rows, const float* a, int64_t lda, int nblk, int64_t bstep,
            float* C, int64_t ldc, int64_t cstep) {
  constexpr int NB = MM <= 2 ? 2 : 1;    // <= 8 accumulators
  constexpr int KS1 = MM == 1 ? 2 : 1;   // chains of a lone block: >= 4
  int b = 0;
  for (; b + NB <= nblk; b += NB) axpy_tile<MM, NB, 1>(Bt, wdt, ldb, rows, a, lda, b, bstep, C, ldc, cstep);
  for (; b < nblk; ++b) axpy_tile<MM, 1, KS1>(Bt, wdt, ldb, rows, a, lda, b, bstep, C, ldc, cstep);
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
