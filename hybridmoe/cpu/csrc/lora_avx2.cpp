// The expert LoRA kernels (lora.h LoraKernels) in AVX2 + FMA: 8 fp32 lanes, bf16 widened by a
// shift, a scalar tail for a dot whose length is not a multiple of 8.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "common.h"
#include "lora.h"

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

void dot(const void* A, int wdt, int64_t lda, int rows, const void* x, int xdt, int n, float s, float* out) {
  const int n8 = n / 8 * 8;
  int k = 0;
  for (; k + 4 <= rows; k += 4) {  // four rows share each x load
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    const void *a0 = row(A, wdt, k * lda), *a1 = row(A, wdt, (k + 1) * lda), *a2 = row(A, wdt, (k + 2) * lda),
               *a3 = row(A, wdt, (k + 3) * lda);
    for (int i = 0; i < n8; i += 8) {
      const __m256 xv = load8(x, xdt, i);
      c0 = _mm256_fmadd_ps(load8(a0, wdt, i), xv, c0);
      c1 = _mm256_fmadd_ps(load8(a1, wdt, i), xv, c1);
      c2 = _mm256_fmadd_ps(load8(a2, wdt, i), xv, c2);
      c3 = _mm256_fmadd_ps(load8(a3, wdt, i), xv, c3);
    }
    float r0 = hsum(c0), r1 = hsum(c1), r2 = hsum(c2), r3 = hsum(c3);
    for (int i = n8; i < n; ++i) {
      const float xv = load1(x, xdt, i);
      r0 += load1(a0, wdt, i) * xv;
      r1 += load1(a1, wdt, i) * xv;
      r2 += load1(a2, wdt, i) * xv;
      r3 += load1(a3, wdt, i) * xv;
    }
    out[k] = s * r0;
    out[k + 1] = s * r1;
    out[k + 2] = s * r2;
    out[k + 3] = s * r3;
  }
  for (; k < rows; ++k) {
    __m256 c = _mm256_setzero_ps();
    const void* a = row(A, wdt, k * lda);
    for (int i = 0; i < n8; i += 8) c = _mm256_fmadd_ps(load8(a, wdt, i), load8(x, xdt, i), c);
    float r = hsum(c);
    for (int i = n8; i < n; ++i) r += load1(a, wdt, i) * load1(x, xdt, i);
    out[k] = s * r;
  }
}

void axpy(const void* Bt, int wdt, int64_t ldb, int rows, const float* a, int nblk, int64_t bstep, float* C,
          int64_t cstep) {
  int b = 0;
  for (; b + 2 <= nblk; b += 2) {  // four independent accumulators: not bound by the FMA latency
    float* c = C + b * cstep;
    __m256 c0 = _mm256_loadu_ps(c), c1 = _mm256_loadu_ps(c + 8), c2 = _mm256_loadu_ps(c + cstep),
           c3 = _mm256_loadu_ps(c + cstep + 8);
    for (int k = 0; k < rows; ++k) {
      const __m256 ak = _mm256_set1_ps(a[k]);
      const int64_t o = k * ldb + b * bstep;
      c0 = _mm256_fmadd_ps(ak, load8(Bt, wdt, o), c0);
      c1 = _mm256_fmadd_ps(ak, load8(Bt, wdt, o + 8), c1);
      c2 = _mm256_fmadd_ps(ak, load8(Bt, wdt, o + bstep), c2);
      c3 = _mm256_fmadd_ps(ak, load8(Bt, wdt, o + bstep + 8), c3);
    }
    _mm256_storeu_ps(c, c0);
    _mm256_storeu_ps(c + 8, c1);
    _mm256_storeu_ps(c + cstep, c2);
    _mm256_storeu_ps(c + cstep + 8, c3);
  }
  for (; b < nblk; ++b) {
    float* c = C + b * cstep;
    __m256 lo = _mm256_loadu_ps(c), hi = _mm256_loadu_ps(c + 8);
    for (int k = 0; k < rows; ++k) {
      const __m256 ak = _mm256_set1_ps(a[k]);
      const int64_t off = k * ldb + b * bstep;
      lo = _mm256_fmadd_ps(ak, load8(Bt, wdt, off), lo);
      hi = _mm256_fmadd_ps(ak, load8(Bt, wdt, off + 8), hi);
    }
    _mm256_storeu_ps(c, lo);
    _mm256_storeu_ps(c + 8, hi);
  }
}

const hm::LoraKernels kLora = {dot, axpy};

}  // namespace

extern "C" const hm::LoraKernels* hm_lora_kernels_avx2() { return &kLora; }
