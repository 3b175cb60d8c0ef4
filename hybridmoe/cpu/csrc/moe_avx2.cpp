// AVX2 + FMA kernels (baseline path). Activation formats: int8/int4 methods -> int8 q per row
// (scale = amax/127, q = round(x * 127/amax)); BF16 method -> fp32 rows; FP8 -> fp32 rows rounded
// to bf16 (the AVX-512/AMX FP8 kernels' activations, so every ISA computes the same products).
// FP8 weights are widened to fp32 and scaled in one multiply (fp8x8), then fp32 FMA.
// int8 dot: maddubs(|x|, sign(w, x)) (no saturation: |w|, |x| <= 127); int4: maddubs(nibble, x).
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "common.h"

namespace hm {
namespace {

// Local helpers instead of std:: templates: an out-of-line template instance compiled with this
// unit's ISA flags could otherwise be picked by the linker for baseline code.
inline int imin(int a, int b) { return a < b ? a : b; }
inline float fmaxf_(float a, float b) { return a > b ? a : b; }

inline __m256 load8(const void* src, int dt, int64_t i) {
  if (dt == DT_F32) return _mm256_loadu_ps(static_cast<const float*>(src) + i);
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(src) + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

inline float load1(const void* src, int dt, int64_t i) {
  if (dt == DT_F32) return static_cast<const float*>(src)[i];
  uint32_t u = uint32_t(static_cast<const uint16_t*>(src)[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline int32_t load_i32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

int64_t act_row_bytes(int method, int Kdp) {
  return method == M_BF16 || method == M_FP8 ? int64_t(Kdp) * 4 : int64_t(Kdp);
}

// fp32 -> the nearest bf16 (ties to even), kept as fp32; finite inputs
inline __m256 round_bf16_8(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(int(0xFFFF0000u))));
}

inline float round_bf16_1(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

bool quant_row(int method, const void* src, int dt, int K, int Kdp, int G, uint8_t* dst, float* scale,
               int32_t* gsum) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), inf = _mm256_set1_ps(INFINITY);
  __m256 vmax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= K; i += 8) {
    __m256 a = _mm256_and_ps(load8(src, dt, i), absmask);
    vmax = _mm256_max_ps(vmax, a);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));
  }
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, vmax);
  float amax = 0.0f;
  for (float v : tmp) amax = fmaxf_(amax, v);
  bool finite = _mm256_movemask_ps(bad) == 0;
  for (; i < K; ++i) {
    float a = std::fabs(load1(src, dt, i));
    finite = finite && std::isfinite(a);
    amax = fmaxf_(amax, a);
  }
  if (!finite) return false;
  if (method == M_BF16) {
    float* o = reinterpret_cast<float*>(dst);
    for (i = 0; i + 8 <= K; i += 8) _mm256_storeu_ps(o + i, load8(src, dt, i));
    for (; i < K; ++i) o[i] = load1(src, dt, i);
    for (; i < Kdp; ++i) o[i] = 0.0f;
    return true;
  }
  if (method == M_FP8) {
    float* o = reinterpret_cast<float*>(dst);
    for (i = 0; i + 8 <= K; i += 8) _mm256_storeu_ps(o + i, round_bf16_8(load8(src, dt, i)));
    for (; i < K; ++i) o[i] = round_bf16_1(load1(src, dt, i));
    for (; i < Kdp; ++i) o[i] = 0.0f;
    return true;
  }
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  *scale = amax / 127.0f;
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int8_t* q = reinterpret_cast<int8_t*>(dst);
  for (i = 0; i + 32 <= K; i += 32) {
    __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(load8(src, dt, i), vinv));
    __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(load8(src, dt, i + 8), vinv));
    __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(load8(src, dt, i + 16), vinv));
    __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(load8(src, dt, i + 24), vinv));
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_permutevar8x32_epi32(p, perm));
  }
  for (; i < K; ++i) q[i] = int8_t(std::nearbyint(load1(src, dt, i) * inv));
  for (; i < Kdp; ++i) q[i] = 0;
  if (method == M_INT4)
    for (int g = 0; g < Kdp / G; ++g) {
      int32_t s = 0;
      for (int j = 0; j < G; ++j) s += q[g * G + j];
      gsum[g] = s;
    }
  return true;
}

template <int MT>
void blk_i8(const uint8_t* wb, int Kd, const ActView& A, int m0, const float* sw, float* C, int64_t ldc) {
  __m256i acc[MT][2];
  for (int t = 0; t < MT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const int pf = A.prefetch;
  for (int s = 0; s < Kd / 4; ++s) {
    if (pf) _mm_prefetch(reinterpret_cast<const char*>(wb + s * 64 + pf), _MM_HINT_T0);  // never faults
    __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + s * 64));
    __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + s * 64 + 32));
    for (int t = 0; t < MT; ++t) {
      __m256i xb = _mm256_set1_epi32(load_i32(A.data + (m0 + t) * A.ld + 4 * s)), ax = _mm256_abs_epi8(xb);
      acc[t][0] = _mm256_add_epi32(acc[t][0], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xb)), ones));
      acc[t][1] = _mm256_add_epi32(acc[t][1], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xb)), ones));
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int h = 0; h < 2; ++h) {
      __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[t][h]), _mm256_set1_ps(A.scale[m0 + t]));
      _mm256_storeu_ps(C + t * ldc + 8 * h, _mm256_mul_ps(f, _mm256_loadu_ps(sw + 8 * h)));
    }
}

template <int MT, bool ASYM>
void blk_i4(const uint8_t* wb, int Kd, int G, const ActView& A, int m0, const float* d, const float* z, float* C,
            int64_t ldc) {
  __m256 facc[MT][2];
  for (int t = 0; t < MT; ++t) facc[t][0] = facc[t][1] = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int upg = G / 8;
  const int pf = A.prefetch;
  for (int g = 0; g < Kd / G; ++g) {
    __m256i iacc[MT][2];
    for (int t = 0; t < MT; ++t) iacc[t][0] = iacc[t][1] = _mm256_setzero_si256();
    for (int u = g * upg; u < (g + 1) * upg; ++u) {
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(wb + u * 64 + pf), _MM_HINT_T0);
      __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + u * 64));
      __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + u * 64 + 32));
      __m256i lo0 = _mm256_and_si256(v0, mask), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), mask);
      __m256i lo1 = _mm256_and_si256(v1, mask), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), mask);
      for (int t = 0; t < MT; ++t) {
        const uint8_t* x = A.data + (m0 + t) * A.ld + 8 * u;
        __m256i xa = _mm256_set1_epi32(load_i32(x)), xb = _mm256_set1_epi32(load_i32(x + 4));
        iacc[t][0] = _mm256_add_epi32(
            iacc[t][0], _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo0, xa), _mm256_maddubs_epi16(hi0, xb)), ones));
        iacc[t][1] = _mm256_add_epi32(
            iacc[t][1], _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo1, xa), _mm256_maddubs_epi16(hi1, xb)), ones));
      }
    }
    for (int t = 0; t < MT; ++t) {
      const float sx = A.scale[m0 + t];
      const int32_t gs = A.gsum[(m0 + t) * A.gstride + g];
      for (int h = 0; h < 2; ++h) {
        __m256 dg = _mm256_mul_ps(_mm256_loadu_ps(d + g * 16 + 8 * h), _mm256_set1_ps(sx));
        if (ASYM) {
          facc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[t][h]), dg, facc[t][h]);
          facc[t][h] = _mm256_fmadd_ps(_mm256_loadu_ps(z + g * 16 + 8 * h), _mm256_set1_ps(sx * float(gs)), facc[t][h]);
        } else {
          __m256i v = _mm256_sub_epi32(iacc[t][h], _mm256_set1_epi32(8 * gs));
          facc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), dg, facc[t][h]);
        }
      }
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(C + t * ldc + 8 * h, facc[t][h]);
}

template <int MT>
void blk_bf16(const uint8_t* wb, int Kd, const ActView& A, int m0, float* C, int64_t ldc) {
  __m256 acc[MT][2];
  for (int t = 0; t < MT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  const __m256i himask = _mm256_set1_epi32(int(0xFFFF0000u));
  const int pf = A.prefetch;
  for (int s = 0; s < Kd / 2; ++s) {
    if (pf) _mm_prefetch(reinterpret_cast<const char*>(wb + s * 64 + pf), _MM_HINT_T0);
    __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + s * 64));
    __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + s * 64 + 32));
    __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)), o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, himask));
    __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16)), o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, himask));
    for (int t = 0; t < MT; ++t) {
      const float* x = reinterpret_cast<const float*>(A.data + (m0 + t) * A.ld) + 2 * s;
      __m256 x0 = _mm256_set1_ps(x[0]), x1 = _mm256_set1_ps(x[1]);
      acc[t][0] = _mm256_fmadd_ps(o0, x1, _mm256_fmadd_ps(e0, x0, acc[t][0]));
      acc[t][1] = _mm256_fmadd_ps(o1, x1, _mm256_fmadd_ps(e1, x0, acc[t][1]));
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(C + t * ldc + 8 * h, acc[t][h]);
}

// 8 e4m3 bytes -> 8 fp32 times f. The byte's bits placed in a fp32 (sign at 31, exponent field e in
// 0..15, mantissa m << 20) read 2^(e-127) (1 + m/8) for e > 0 and the fp32 subnormal m * 2^-129 for
// e == 0: both the e4m3 value times 2^-120, so f = scale * 2^120 widens, rebiases and scales in one
// exact-then-rounded multiply (the reference's fp8 * scale in fp32). Needs denormal inputs honoured
// (MXCSR DAZ off: gemm_fp8 makes sure). The NaN codes are refused at packing.
inline __m256 fp8x8(const uint8_t* p, __m256 f) {
  __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  v = _mm256_and_si256(_mm256_slli_epi32(v, 20), _mm256_set1_epi32(int(0x87F00000u)));
  return _mm256_mul_ps(_mm256_castsi256_ps(v), f);
}

// FP8 block x MT rows: per step, 4 registers of (row, k parity) lanes: rows 4q..4q+3 x (k, k+1), the
// 8 bytes at line offset 16q + 8 * (step parity) (the lane-interleaved line of quant.py pack_pairs).
template <int MT>
void blk_fp8(const uint8_t* wb, int Kd, int G, const ActView& A, int m0, const float* sc, float* C, int64_t ldc) {
  __m256 acc[MT][4];
  for (int t = 0; t < MT; ++t)
    for (int q = 0; q < 4; ++q) acc[t][q] = _mm256_setzero_ps();
  const int spg = G / 2, pf = A.prefetch;
  for (int g = 0; g < Kd / G; ++g) {
    // scale * 2^120 overflows for scales >= 2^8 (weights beyond 2^16, never seen): two multiplies then
    const float f = sc[g] * 0x1p120f;
    const bool two = !(std::fabs(f) <= 3.0e38f);
    const __m256 vf = _mm256_set1_ps(two ? 0x1p120f : f), vs = _mm256_set1_ps(sc[g]);
    for (int s = g * spg; s < (g + 1) * spg; ++s) {
      if (pf && !(s & 1)) _mm_prefetch(reinterpret_cast<const char*>(wb + s * 32 + pf), _MM_HINT_T0);  // per line
      const uint8_t* w = wb + (s >> 1) * 64 + (s & 1) * 8;
      __m256 w0 = fp8x8(w, vf), w1 = fp8x8(w + 16, vf), w2 = fp8x8(w + 32, vf), w3 = fp8x8(w + 48, vf);
      if (two) {
        w0 = _mm256_mul_ps(w0, vs);
        w1 = _mm256_mul_ps(w1, vs);
        w2 = _mm256_mul_ps(w2, vs);
        w3 = _mm256_mul_ps(w3, vs);
      }
      for (int t = 0; t < MT; ++t) {  // x pair (2s, 2s+1) in every lane pair
        const __m256 x = _mm256_castpd_ps(
            _mm256_broadcast_sd(reinterpret_cast<const double*>(A.data + (m0 + t) * A.ld + 8 * s)));
        acc[t][0] = _mm256_fmadd_ps(w0, x, acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(w1, x, acc[t][1]);
        acc[t][2] = _mm256_fmadd_ps(w2, x, acc[t][2]);
        acc[t][3] = _mm256_fmadd_ps(w3, x, acc[t][3]);
      }
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int h = 0; h < 2; ++h) {  // hadd: rows 0,1,4,5,2,3,6,7 (of the half) -> in order
      __m256 r = _mm256_hadd_ps(acc[t][2 * h], acc[t][2 * h + 1]);
      _mm256_storeu_ps(C + t * ldc + 8 * h, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(r), 0xD8)));
    }
}

void gemm_fp8(const PackedMat& W, int e, const ActView& A, int M, int nb0, int nb1, float* C, int64_t ldc, int G) {
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(csr & ~0x8040u);  // DAZ (bit 6) and FTZ (bit 15) off: fp8x8 reads fp32 subnormals
  const uint8_t* base = W.data + int64_t(e) * W.expert_stride;
  const int NBT = W.N / 16, Kd = W.Kd;
  for (int nb = nb0; nb < nb1; ++nb) {
    const uint8_t* wb = base + int64_t(nb) * 16 * Kd;
    const float* sc = W.scale + (int64_t(e) * NBT + nb) * (Kd / G);
    for (int m = 0; m < M; m += 2) {
      if (M - m >= 2)
        blk_fp8<2>(wb, Kd, G, A, m, sc, C + (nb - nb0) * 16 + m * ldc, ldc);
      else
        blk_fp8<1>(wb, Kd, G, A, m, sc, C + (nb - nb0) * 16 + m * ldc, ldc);
    }
  }
  _mm_setcsr(csr);
}

void gemm(int method, const PackedMat& W, int e, const ActView& A, int M, int nb0, int nb1, float* C, int64_t ldc,
          int G) {
  if (method == M_FP8) return gemm_fp8(W, e, A, M, nb0, nb1, C, ldc, G);
  const uint8_t* base = W.data + int64_t(e) * W.expert_stride;
  const int NBT = W.N / 16, Kd = W.Kd;
  for (int nb = nb0; nb < nb1; ++nb) {
    float* Cb = C + (nb - nb0) * 16;
    if (method == M_INT8) {
      const uint8_t* wb = base + int64_t(nb) * 16 * Kd;
      const float* sw = W.scale + int64_t(e) * W.N + nb * 16;
      for (int m = 0; m < M; m += 4) {
        float* Cm = Cb + m * ldc;
        switch (imin(4, M - m)) {
          case 4: blk_i8<4>(wb, Kd, A, m, sw, Cm, ldc); break;
          case 3: blk_i8<3>(wb, Kd, A, m, sw, Cm, ldc); break;
          case 2: blk_i8<2>(wb, Kd, A, m, sw, Cm, ldc); break;
          default: blk_i8<1>(wb, Kd, A, m, sw, Cm, ldc);
        }
      }
    } else if (method == M_INT4) {
      const uint8_t* wb = base + int64_t(nb) * 8 * Kd;
      int64_t so = (int64_t(e) * NBT + nb) * (Kd / G) * 16;
      const float* d = W.scale + so;
      const float* z = W.zero ? W.zero + so : nullptr;
      for (int m = 0; m < M; m += 2) {
        float* Cm = Cb + m * ldc;
        bool two = M - m >= 2;
        if (z)
          two ? blk_i4<2, true>(wb, Kd, G, A, m, d, z, Cm, ldc) : blk_i4<1, true>(wb, Kd, G, A, m, d, z, Cm, ldc);
        else
          two ? blk_i4<2, false>(wb, Kd, G, A, m, d, z, Cm, ldc) : blk_i4<1, false>(wb, Kd, G, A, m, d, z, Cm, ldc);
      }
    } else {
      const uint8_t* wb = base + int64_t(nb) * 32 * Kd;
      for (int m = 0; m < M; m += 4) {
        float* Cm = Cb + m * ldc;
        switch (imin(4, M - m)) {
          case 4: blk_bf16<4>(wb, Kd, A, m, Cm, ldc); break;
          case 3: blk_bf16<3>(wb, Kd, A, m, Cm, ldc); break;
          case 2: blk_bf16<2>(wb, Kd, A, m, Cm, ldc); break;
          default: blk_bf16<1>(wb, Kd, A, m, Cm, ldc);
        }
      }
    }
  }
}

const Kernels kTable = {"avx2", act_row_bytes, quant_row, gemm, nullptr};

}  // namespace
}  // namespace hm

extern "C" const hm::Kernels* hm_kernels_avx2() { return &hm::kTable; }
