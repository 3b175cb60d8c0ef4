// The expert LoRA kernels (lora.h LoraKernels) in AVX-512 (F + BW + VL + BF16): 16 fp32 lanes, weights and
// inputs widened from bf16 by a shift, masked loads for the tail of a dot; tiles of up to four rows of
// one (expert, slot) x four ranks or blocks in registers. Also run on the AMX path.
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

// A tile of MM rows x RK ranks (MM * RK accumulators): each x load serves RK ranks, each A load MM rows.
template <int MM, int RK>
inline void dot_tile(const void* A, int wdt, int64_t lda, int k, const void* const* x, int xdt, int n, float s,
                     float* out, int64_t ldo) {
  __m512 c[MM][RK];
  const void* a[RK];
  #pragma GCC unroll 16
  for (int r = 0; r < RK; ++r) a[r] = row(A, wdt, (k + r) * lda);
  #pragma GCC unroll 16
  for (int m = 0; m < MM; ++m)
    #pragma GCC unroll 16
    for (int r = 0; r < RK; ++r) c[m][r] = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16) {
    const int left = n - i;
    __m512 xv[MM];
    #pragma GCC unroll 16
    for (int m = 0; m < MM; ++m) xv[m] = load16(x[m], xdt, i, left);
    #pragma GCC unroll 16
    for (int r = 0; r < RK; ++r) {
      const __m512 av = load16(a[r], wdt, i, left);
      #pragma GCC unroll 16
      for (int m = 0; m < MM; ++m) c[m][r] = _mm512_fmadd_ps(av, xv[m], c[m][r]);
    }
  }
  #pragma GCC unroll 16
  for (int m = 0; m < MM; ++m)
    #pragma GCC unroll 16
    for (int r = 0; r < RK; ++r) out[m * ldo + k + r] = s * _mm512_reduce_add_ps(c[m][r]);
}

// 32 bf16 values from p + i, lanes >= left zero
inline __m512bh load32bh(const void* p, int64_t i, int left) {
  const __mmask32 m = left >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << left) - 1);
  return (__m512bh)_mm512_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i);
}

// dot_tile for bf16 weights and bf16 x (a bf16 model's gate/up input): vdpbf16ps takes the pairs as
// they are (exact products, fp32 sums; the AVX-512 path requires avx512_bf16, dispatch.cpp), no
// widening: half the instructions per product.
template <int MM, int RK>
inline void dot_tile_bf16(const void* A, int64_t lda, int k, const void* const* x, int n, float s, float* out,
                          int64_t ldo) {
  __m512 c[MM][RK];
  const void* a[RK];
  #pragma GCC unroll 16
  for (int r = 0; r < RK; ++r) a[r] = row(A, hm::DT_BF16, (k + r) * lda);
  #pragma GCC unroll 16
  for (int m = 0; m < MM; ++m)
    #pragma GCC unroll 16
    for (int r = 0; r < RK; ++r) c[m][r] = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 32) {
    const int left = n - i;
    __m512bh xv[MM];
    #pragma GCC unroll 16
    for (int m = 0; m < MM; ++m) xv[m] = load32bh(x[m], i, left);
    #pragma GCC unroll 16
    for (int r = 0; r < RK; ++r) {
      const __m512bh av = load32bh(a[r], i, left);
      #pragma GCC unroll 16
      for (int m = 0; m < MM; ++m) c[m][r] = _mm512_dpbf16_ps(c[m][r], av, xv[m]);
    }
  }
  #pragma GCC unroll 16
  for (int m = 0; m < MM; ++m)
    #pragma GCC unroll 16
    for (int r = 0; r < RK; ++r) out[m * ldo + k + r] = s * _mm512_reduce_add_ps(c[m][r]);
}

template <int MM>
void dot_m(const void* A, int wdt, int64_t lda, int rows, const void* const* x, int xdt, int n, float s, float* out,
           int64_t ldo) {
  int k = 0;
  if (wdt == hm::DT_BF16 && xdt == hm::DT_BF16) {
    for (; k + 4 <= rows; k += 4) dot_tile_bf16<MM, 4>(A, lda, k, x, n, s, out, ldo);
    for (; k < rows; ++k) dot_tile_bf16<MM, 1>(A, lda, k, x, n, s, out, ldo);
    return;
  }
  for (; k + 4 <= rows; k += 4) dot_tile<MM, 4>(A, wdt, lda, k, x, xdt, n, s, out, ldo);
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

// MM rows x NB blocks, the rank sum split KS ways: MM * NB * KS independent FMA chains (each B load
// serves MM rows), so one row and one block is not bound by the FMA latency either.
template <int MM, int NB, int KS>
inline void axpy_tile(const void* Bt, int wdt, int64_t ldb, int rows, const float* a, int64_t lda, int b,
                      int64_t bstep, float* C, int64_t ldc, int64_t cstep) {
  __m512 acc[KS][MM][NB];
  #pragma GCC unroll 16
  for (int m = 0; m < MM; ++m)
    #pragma GCC unroll 16
    for (int j = 0; j < NB; ++j) {
      acc[0][m][j] = _mm512_loadu_ps(C + m * ldc + (b + j) * cstep);
      #pragma GCC unroll 16
      for (int q = 1; q < KS; ++q) acc[q][m][j] = _mm512_setzero_ps();
    }
  int k = 0;
  for (; k + KS <= rows; k += KS)
    #pragma GCC unroll 16
    for (int q = 0; q < KS; ++q) {
      const int64_t o = (k + q) * ldb + b * bstep;
      __m512 bv[NB];
      #pragma GCC unroll 16
      for (int j = 0; j < NB; ++j) bv[j] = load16(Bt, wdt, o + j * bstep);
      #pragma GCC unroll 16
      for (int m = 0; m < MM; ++m) {
        const __m512 am = _mm512_set1_ps(a[m * lda + k + q]);
        #pragma GCC unroll 16
        for (int j = 0; j < NB; ++j) acc[q][m][j] = _mm512_fmadd_ps(am, bv[j], acc[q][m][j]);
      }
    }
  for (; k < rows; ++k) {
    const int64_t o = k * ldb + b * bstep;
    #pragma GCC unroll 16
    for (int j = 0; j < NB; ++j) {
      const __m512 bv = load16(Bt, wdt, o + j * bstep);
      #pragma GCC unroll 16
      for (int m = 0; m < MM; ++m) acc[0][m][j] = _mm512_fmadd_ps(_mm512_set1_ps(a[m * lda + k]), bv, acc[0][m][j]);
    }
  }
  #pragma GCC unroll 16
  for (int m = 0; m < MM; ++m)
    #pragma GCC unroll 16
    for (int j = 0; j < NB; ++j) {
      __m512 v = acc[0][m][j];
      #pragma GCC unroll 16
      for (int q = 1; q < KS; ++q) v = _mm512_add_ps(v, acc[q][m][j]);
      _mm512_storeu_ps(C + m * ldc + (b + j) * cstep, v);
    }
}

template <int MM>
void axpy_m(const void* Bt, int wdt, int64_t ldb, int rows, const float* a, int64_t lda, int nblk, int64_t bstep,
            float* C, int64_t ldc, int64_t cstep) {
  constexpr int KS1 = MM >= 4 ? 1 : MM == 1 ? 4 : 2;  // chains of a lone block: >= 4
  int b = 0;
  for (; b + 4 <= nblk; b += 4) axpy_tile<MM, 4, 1>(Bt, wdt, ldb, rows, a, lda, b, bstep, C, ldc, cstep);
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

extern "C" const hm::LoraKernels* hm_lora_kernels_avx512() { return &kLora; }
