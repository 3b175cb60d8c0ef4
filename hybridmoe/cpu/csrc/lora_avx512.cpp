// The expert LoRA kernels (lora.h LoraKernels) in AVX-512 (F + BW + VL): 16 fp32 lanes, weights and
// inputs widened from bf16 by a shift, masked loads for the tail of a dot. Also run on the AMX path.
#include <immintrin.h>

#include <cstdint>

#include "common.h"
#include "lora.h"

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

void dot(const void* A, int wdt, int64_t lda, int rows, const void* x, int xdt, int n, float s, float* out) {
  int k = 0;
  for (; k + 4 <= rows; k += 4) {  // four rows share each x load
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    const void *a0 = row(A, wdt, k * lda), *a1 = row(A, wdt, (k + 1) * lda), *a2 = row(A, wdt, (k + 2) * lda),
               *a3 = row(A, wdt, (k + 3) * lda);
    for (int i = 0; i < n; i += 16) {
      const int m = n - i;
      const __m512 xv = load16(x, xdt, i, m);
      c0 = _mm512_fmadd_ps(load16(a0, wdt, i, m), xv, c0);
      c1 = _mm512_fmadd_ps(load16(a1, wdt, i, m), xv, c1);
      c2 = _mm512_fmadd_ps(load16(a2, wdt, i, m), xv, c2);
      c3 = _mm512_fmadd_ps(load16(a3, wdt, i, m), xv, c3);
    }
    out[k] = s * _mm512_reduce_add_ps(c0);
    out[k + 1] = s * _mm512_reduce_add_ps(c1);
    out[k + 2] = s * _mm512_reduce_add_ps(c2);
    out[k + 3] = s * _mm512_reduce_add_ps(c3);
  }
  for (; k < rows; ++k) {
    __m512 c = _mm512_setzero_ps();
    const void* a = row(A, wdt, k * lda);
    for (int i = 0; i < n; i += 16) c = _mm512_fmadd_ps(load16(a, wdt, i, n - i), load16(x, xdt, i, n - i), c);
    out[k] = s * _mm512_reduce_add_ps(c);
  }
}

void axpy(const void* Bt, int wdt, int64_t ldb, int rows, const float* a, int nblk, int64_t bstep, float* C,
          int64_t cstep) {
  int b = 0;
  for (; b + 4 <= nblk; b += 4) {  // four independent accumulators: not bound by the FMA latency
    float* c = C + b * cstep;
    __m512 c0 = _mm512_loadu_ps(c), c1 = _mm512_loadu_ps(c + cstep), c2 = _mm512_loadu_ps(c + 2 * cstep),
           c3 = _mm512_loadu_ps(c + 3 * cstep);
    for (int k = 0; k < rows; ++k) {
      const __m512 ak = _mm512_set1_ps(a[k]);
      const int64_t o = k * ldb + b * bstep;
      c0 = _mm512_fmadd_ps(ak, load16(Bt, wdt, o), c0);
      c1 = _mm512_fmadd_ps(ak, load16(Bt, wdt, o + bstep), c1);
      c2 = _mm512_fmadd_ps(ak, load16(Bt, wdt, o + 2 * bstep), c2);
      c3 = _mm512_fmadd_ps(ak, load16(Bt, wdt, o + 3 * bstep), c3);
    }
    _mm512_storeu_ps(c, c0);
    _mm512_storeu_ps(c + cstep, c1);
    _mm512_storeu_ps(c + 2 * cstep, c2);
    _mm512_storeu_ps(c + 3 * cstep, c3);
  }
  for (; b < nblk; ++b) {
    float* c = C + b * cstep;
    __m512 acc = _mm512_loadu_ps(c);
    for (int k = 0; k < rows; ++k) acc = _mm512_fmadd_ps(_mm512_set1_ps(a[k]), load16(Bt, wdt, k * ldb + b * bstep), acc);
    _mm512_storeu_ps(c, acc);
  }
}

const hm::LoraKernels kLora = {dot, axpy};

}  // namespace

extern "C" const hm::LoraKernels* hm_lora_kernels_avx512() { return &kLora; }
