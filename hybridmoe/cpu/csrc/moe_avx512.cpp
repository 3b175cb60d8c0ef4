// AVX-512 kernels (F/BW/VL + VNNI + BF16). Activation formats: int8 method -> u8 = q + 128 per row
// (dot = dpbusd(u8, w) - 128 * rowsum(w)); int4 -> s8 q (dpbusd(nibble, q)); BF16 and FP8 -> bf16
// rows (dpbf16ps; FP8 widens its weights to bf16 in registers, fp8_line_at, and scales each K
// group's partial dot). q = round(x * 127/amax), scale = amax/127, exactly as the AVX2 path.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "kernels_avx512.h"

namespace hm {
namespace avx512 {
namespace {

// Local helpers instead of std:: templates: an out-of-line template instance compiled with this
// unit's ISA flags could otherwise be picked by the linker for baseline code.
inline int imin(int a, int b) { return a < b ? a : b; }
inline float fmaxf_(float a, float b) { return a > b ? a : b; }

constexpr int MT = 8;  // rows per register block

inline int32_t load_i32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline __m512 load16(const void* src, int dt, int64_t i, __mmask16 m) {
  if (dt == DT_F32) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(src) + i);
  __m256i v = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(src) + i);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
}

template <int R>
void blk_i8(const uint8_t* wb, int Kd, const ActView& A, int m0, const float* sw, const int32_t* wsum, float* C,
            int64_t ldc) {
  __m512i acc[2][R];
  for (int t = 0; t < R; ++t) acc[0][t] = acc[1][t] = _mm512_setzero_si512();
  const uint8_t* x[R];
  for (int t = 0; t < R; ++t) x[t] = A.data + (m0 + t) * A.ld;
  const int pf = A.prefetch;
  for (int s = 0; s < Kd / 4; s += 2) {
    if (pf) {  // prefetches never fault: reading past the block only warms the next one
      _mm_prefetch(reinterpret_cast<const char*>(wb + s * 64 + pf), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wb + s * 64 + 64 + pf), _MM_HINT_T0);
    }
    __m512i w0 = _mm512_loadu_si512(wb + s * 64), w1 = _mm512_loadu_si512(wb + s * 64 + 64);
    for (int t = 0; t < R; ++t) {
      acc[0][t] = _mm512_dpbusd_epi32(acc[0][t], _mm512_set1_epi32(load_i32(x[t] + 4 * s)), w0);
      acc[1][t] = _mm512_dpbusd_epi32(acc[1][t], _mm512_set1_epi32(load_i32(x[t] + 4 * s + 4)), w1);
    }
  }
  __m512i comp = _mm512_slli_epi32(_mm512_loadu_si512(wsum), 7);
  __m512 vsw = _mm512_loadu_ps(sw);
  for (int t = 0; t < R; ++t) {
    __m512i v = _mm512_sub_epi32(_mm512_add_epi32(acc[0][t], acc[1][t]), comp);
    __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(A.scale[m0 + t]));
    _mm512_storeu_ps(C + t * ldc, _mm512_mul_ps(f, vsw));
  }
}

template <int R, bool ASYM>
void blk_i4(const uint8_t* wb, int Kd, int G, const ActView& A, int m0, const float* d, const float* z, float* C,
            int64_t ldc) {
  __m512 facc[R];
  for (int t = 0; t < R; ++t) facc[t] = _mm512_setzero_ps();
  // lo = v & 0x0F and hi16 = v & 0xF0 = 16 * hi: two uops per loaded line instead of three (no
  // shift), so more weight loads fit in the core's scheduler ahead of the dots that wait on them;
  // the hi dots are scaled back by an exact arithmetic shift (a sum of multiples of 16).
  const __m512i mask = _mm512_set1_epi8(0x0F), mask_hi = _mm512_set1_epi8(char(0xF0));
  const uint8_t* x[R];
  for (int t = 0; t < R; ++t) x[t] = A.data + (m0 + t) * A.ld;
  const int upg = G / 8;
  const int pf = A.prefetch;
  for (int g = 0; g < Kd / G; ++g) {
    __m512i ia[R], ib[R];
    for (int t = 0; t < R; ++t) ia[t] = ib[t] = _mm512_setzero_si512();
    for (int u = g * upg; u < (g + 1) * upg; ++u) {
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(wb + u * 64 + pf), _MM_HINT_T0);
      __m512i v = _mm512_loadu_si512(wb + u * 64);
      __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(v, mask_hi);
      for (int t = 0; t < R; ++t) {
        ia[t] = _mm512_dpbusd_epi32(ia[t], lo, _mm512_set1_epi32(load_i32(x[t] + 8 * u)));
        ib[t] = _mm512_dpbusd_epi32(ib[t], hi, _mm512_set1_epi32(load_i32(x[t] + 8 * u + 4)));
      }
    }
    __m512 dg = _mm512_loadu_ps(d + g * 16);
    for (int t = 0; t < R; ++t) {
      const float sx = A.scale[m0 + t];
      const int32_t gs = A.gsum[(m0 + t) * A.gstride + g];
      __m512i sum = _mm512_add_epi32(ia[t], _mm512_srai_epi32(ib[t], 4));
      if (ASYM) {
        facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dg, _mm512_set1_ps(sx)), facc[t]);
        facc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(z + g * 16), _mm512_set1_ps(sx * float(gs)), facc[t]);
      } else {
        sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(8 * gs));
        facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dg, _mm512_set1_ps(sx)), facc[t]);
      }
    }
  }
  for (int t = 0; t < R; ++t) _mm512_storeu_ps(C + t * ldc, facc[t]);
}

template <int R>
void blk_bf16(const uint8_t* wb, int Kd, const ActView& A, int m0, float* C, int64_t ldc) {
  __m512 acc[2][R];
  for (int t = 0; t < R; ++t) acc[0][t] = acc[1][t] = _mm512_setzero_ps();
  const uint8_t* x[R];
  for (int t = 0; t < R; ++t) x[t] = A.data + (m0 + t) * A.ld;
  const int pf = A.prefetch;
  for (int s = 0; s < Kd / 2; s += 2) {
    if (pf) {
      _mm_prefetch(reinterpret_cast<const char*>(wb + s * 64 + pf), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wb + s * 64 + 64 + pf), _MM_HINT_T0);
    }
    __m512i w0 = _mm512_loadu_si512(wb + s * 64), w1 = _mm512_loadu_si512(wb + s * 64 + 64);
    for (int t = 0; t < R; ++t) {
      acc[0][t] = _mm512_dpbf16_ps(acc[0][t], (__m512bh)w0, (__m512bh)_mm512_set1_epi32(load_i32(x[t] + 4 * s)));
      acc[1][t] = _mm512_dpbf16_ps(acc[1][t], (__m512bh)w1, (__m512bh)_mm512_set1_epi32(load_i32(x[t] + 4 * s + 4)));
    }
  }
  for (int t = 0; t < R; ++t) _mm512_storeu_ps(C + t * ldc, _mm512_add_ps(acc[0][t], acc[1][t]));
}

// e4m3 -> bf16, exact (every e4m3 value is a bf16 value), 64 at a time: the low and the high byte of
// each bf16 are looked up in 128-entry tables by the code's low 7 bits (vpermi2b, AVX512-VBMI: zero,
// subnormals m * 2^-9 and NaN included), the sign bit is or-ed into the high byte, and unpacking
// low/high bytes gives the words. Unpacking works per 128-bit lane, so the packer stores each 64-byte
// line (two 32-value steps) lane-interleaved: line byte 16L + 8p + i = value 8L + i of step p
// (quant.py pack_pairs); the unpacks then return step 0 and step 1 in order.
struct Fp8Tables {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
  constexpr Fp8Tables() : lo(), hi() {
    for (int c = 0; c < 128; ++c) {
      const int e = c >> 3, m = c & 7;
      int v = 0;  // bf16 bits of the magnitude
      if (c == 127) {
        v = 0x7FC0;  // NaN
      } else if (e > 0) {
        v = (e + 120) << 7 | m << 4;
      } else if (m > 0) {  // m * 2^-9 = 2^(p - 9) * (m / 2^p), p = the top bit of m
        const int p = m >= 4 ? 2 : m >= 2 ? 1 : 0;
        v = (127 + p - 9) << 7 | (m - (1 << p)) << (7 - p);
      }
      lo[c] = uint8_t(v & 0xFF);
      hi[c] = uint8_t(v >> 8);
    }
  }
};
constexpr Fp8Tables kFp8{};

struct Fp8Regs {
  __m512i lo0, lo1, hi0, hi1, sign;
  Fp8Regs()
      : lo0(_mm512_load_si512(kFp8.lo)), lo1(_mm512_load_si512(kFp8.lo + 64)), hi0(_mm512_load_si512(kFp8.hi)),
        hi1(_mm512_load_si512(kFp8.hi + 64)), sign(_mm512_set1_epi8(char(0x80))) {}
};

// The few-row kernels' inner loop in asm pieces that all address memory off one index register i
// (the activation byte offset of the iteration's first step; its weights are at wb + 8 * i): with
// intrinsics or "m" operands gcc keeps a pointer per row and adds to each every iteration. The
// kernels are memory-bound: their uops per line decide how far ahead of the data the core runs.
// The line widening also serves fp8_to_bf16. (Memory is read through register operands, not
// declared to the compiler: nothing writes the weights or activations while a kernel runs.)

// The line at wb + 8 * i + D -> its two steps as bf16 (w0: the even step, w1: the odd one): one load,
// the high bytes by vpermt2b (keeps the index b, overwrites a copy of the first table: a register
// move) with the sign or-ed in (hi | b & 0x80), then the low bytes by vpermi2b (overwrites b, no
// longer needed: no copy), 2 unpacks. 7 vector instructions.
template <int D>
inline void fp8_line_at(const Fp8Regs& r, const uint8_t* wb, int64_t i, __m512i& w0, __m512i& w1) {
  __m512i b, hi;
  asm("vmovdqu64 %c[d](%[wb],%[i],8), %[b]\n\t"
      "vmovdqa64 %[hi0], %[hi]\n\t"
      "vpermt2b %[hi1], %[b], %[hi]\n\t"
      "vpternlogd $0xF8, %[sign], %[b], %[hi]\n\t"
      "vpermi2b %[lo1], %[lo0], %[b]\n\t"
      "vpunpcklbw %[hi], %[b], %[w0]\n\t"
      "vpunpckhbw %[hi], %[b], %[w1]"
      : [w0] "=&v"(w0), [w1] "=&v"(w1), [hi] "=&v"(hi), [b] "=&v"(b)
      : [wb] "r"(wb), [i] "r"(i), [d] "i"(D), [lo0] "v"(r.lo0), [lo1] "v"(r.lo1), [hi0] "v"(r.hi0),
        [hi1] "v"(r.hi1), [sign] "v"(r.sign));
}

template <int D>
inline void prefetch_at(const uint8_t* wb, int64_t i) {
  asm volatile("prefetcht0 %c[d](%[wb],%[i],8)" : : [wb] "r"(wb), [i] "r"(i), [d] "i"(D));
}

// acc[t] += w . (the bf16 pair at x[t] + i + D, broadcast) for each row t: the pair is the dot's
// embedded-broadcast operand (gcc does not fold _mm512_set1_epi32 into vdpbf16ps)
template <int R, int D>
inline void dots_at(__m512 (&acc)[R], __m512i w, const uint8_t* const (&x)[R], int64_t i) {
  for (int t = 0; t < R; ++t)
    asm("vdpbf16ps %c[d](%[x],%[i])%{1to16%}, %[w], %[acc]" : [acc] "+v"(acc[t]) : [w] "v"(w), [x] "r"(x[t]),
        [i] "r"(i), [d] "i"(D));
}

// One iteration of blk_fp8_ (below) at activation byte offset i + O: CH / 2 lines, CH dots per row.
template <int R, int CH, bool PF, int O>
inline void fp8_iter(const Fp8Regs& tab, const uint8_t* wb, const uint8_t* wpf, __m512 (&acc)[CH][R],
                     const uint8_t* const (&x)[R], int64_t i) {
  __m512i w0, w1, w2, w3;
  if (PF) prefetch_at<8 * O>(wpf, i);
  fp8_line_at<8 * O>(tab, wb, i, w0, w1);
  if constexpr (CH == 4) {
    if (PF) prefetch_at<8 * O + 64>(wpf, i);
    fp8_line_at<8 * O + 64>(tab, wb, i, w2, w3);
  }
  dots_at<R, O>(acc[0], w0, x, i);
  dots_at<R, O + 4>(acc[1], w1, x, i);
  if constexpr (CH == 4) {
    dots_at<R, O + 8>(acc[2], w2, x, i);
    dots_at<R, O + 12>(acc[3], w3, x, i);
  }
}

// FP8 block, R rows: per K group (G values = G/2 steps) CH dot chains per row, chain c taking the
// steps s with s % CH == c (one per step of an iteration over CH/2 lines: a row's dots are not
// serialized on their latency), then facc += (chain sum) * s[g]. Each widened line serves all R
// rows; per line: one load, 6 vector ops of widening, 2R dots, one prefetch.
// CH = 4 (two lines per iteration) up to 4 rows: the one-row kernel's summation order, so a row's
// result is bit for bit the same whatever the row count of its expert (1..4; tested). 5-8 rows keep
// 2 chains (4 x R accumulators would not fit the 32 registers). PF: software prefetch on (a
// template argument: with the test inside the loop gcc's register allocation adds moves).
template <int R, int CH, bool PF>
void blk_fp8_(const uint8_t* wb, int Kd, int G, const ActView& A, int m0, const float* sc, float* C, int64_t ldc) {
  static_assert(CH == 2 || CH == 4, "one or two lines per iteration");
  __m512 facc[R];
  for (int t = 0; t < R; ++t) facc[t] = _mm512_setzero_ps();
  const uint8_t* x[R];
  for (int t = 0; t < R; ++t) x[t] = A.data + (m0 + t) * A.ld;
  const uint8_t* wpf = wb + A.prefetch;
  const int64_t ipg = 2 * G;  // activation bytes per group (G bf16 values)
  const Fp8Regs tab;
  for (int g = 0; g < Kd / G; ++g) {
    __m512 acc[CH][R];
    for (int c = 0; c < CH; ++c)
      for (int t = 0; t < R; ++t) acc[c][t] = _mm512_setzero_ps();
    // two iterations per trip (G % 32 == 0: a group is 4 or 8 of them): half the loop overhead
    for (int64_t i = g * ipg; i < (g + 1) * ipg; i += 8 * CH) {
      fp8_iter<R, CH, PF, 0>(tab, wb, wpf, acc, x, i);
      fp8_iter<R, CH, PF, 4 * CH>(tab, wb, wpf, acc, x, i);
    }
    const __m512 vs = _mm512_set1_ps(sc[g]);
    for (int t = 0; t < R; ++t) {
      __m512 sum = _mm512_add_ps(acc[0][t], acc[1][t]);
      if constexpr (CH == 4) sum = _mm512_add_ps(sum, _mm512_add_ps(acc[2][t], acc[3][t]));
      facc[t] = _mm512_fmadd_ps(sum, vs, facc[t]);
    }
  }
  for (int t = 0; t < R; ++t) _mm512_storeu_ps(C + t * ldc, facc[t]);
}

template <int R, int CH>
void blk_fp8(const uint8_t* wb, int Kd, int G, const ActView& A, int m0, const float* sc, float* C, int64_t ldc) {
  if (A.prefetch)
    blk_fp8_<R, CH, true>(wb, Kd, G, A, m0, sc, C, ldc);
  else
    blk_fp8_<R, CH, false>(wb, Kd, G, A, m0, sc, C, ldc);
}

#define HM_SWITCH_R(n, CALL) \
  switch (n) {               \
    case 8: CALL(8); break;  \
    case 7: CALL(7); break;  \
    case 6: CALL(6); break;  \
    case 5: CALL(5); break;  \
    case 4: CALL(4); break;  \
    case 3: CALL(3); break;  \
    case 2: CALL(2); break;  \
    default: CALL(1);        \
  }

}  // namespace

int64_t act_row_bytes(int method, int Kdp) {
  return method == M_BF16 || method == M_FP8 ? int64_t(Kdp) * 2 : int64_t(Kdp);
}

void fp8_to_bf16(const uint8_t* src, uint16_t* dst, int64_t steps) {
  const Fp8Regs tab;
  for (int64_t s = 0; s < steps; s += 2) {
    __m512i w0, w1;
    fp8_line_at<0>(tab, src, 4 * s, w0, w1);  // the line at src + 8 * (4 * s) = src + 32 * s
    _mm512_storeu_si512(dst + s * 32, w0);
    _mm512_storeu_si512(dst + s * 32 + 32, w1);
  }
}

bool quant_row(int method, const void* src, int dt, int K, int Kdp, int G, uint8_t* dst, float* scale,
               int32_t* gsum) {
  const __m512 inf = _mm512_set1_ps(INFINITY);
  __m512 vmax = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int i = 0; i < K; i += 16) {
    __m512 a = _mm512_abs_ps(load16(src, dt, i, tail_mask(K - i)));
    vmax = _mm512_max_ps(vmax, a);
    bad = __mmask16(bad | _mm512_cmp_ps_mask(a, inf, _CMP_NLT_UQ));
  }
  if (bad) return false;
  if (method == M_BF16 || method == M_FP8) {
    for (int i = 0; i < Kdp; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * i),
                          (__m256i)_mm512_cvtneps_pbh(load16(src, dt, i, tail_mask(K - i))));
    return true;
  }
  const float amax = _mm512_reduce_max_ps(vmax);
  const __m512 vinv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  *scale = amax / 127.0f;
  if (method == M_INT4)
    for (int g = 0; g < Kdp / G; ++g) gsum[g] = 0;
  for (int i = 0; i < Kdp; i += 16) {
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(src, dt, i, tail_mask(K - i)), vinv));
    if (method == M_INT8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm512_cvtepi32_epi8(_mm512_add_epi32(q, _mm512_set1_epi32(128))));
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm512_cvtepi32_epi8(q));
      gsum[i / G] += _mm512_reduce_add_epi32(q);
    }
  }
  return true;
}

void gemm(int method, const PackedMat& W, int e, const ActView& A, int M, int nb0, int nb1, float* C, int64_t ldc,
          int G) {
  const uint8_t* base = W.data + int64_t(e) * W.expert_stride;
  const int NBT = W.N / 16, Kd = W.Kd;
  for (int nb = nb0; nb < nb1; ++nb) {
    float* Cb = C + (nb - nb0) * 16;
    if (method == M_INT8) {
      const uint8_t* wb = base + int64_t(nb) * 16 * Kd;
      const float* sw = W.scale + int64_t(e) * W.N + nb * 16;
      const int32_t* ws = W.wsum + int64_t(e) * W.N + nb * 16;
      for (int m = 0; m < M; m += MT) {
#define HM_CALL(r) blk_i8<r>(wb, Kd, A, m, sw, ws, Cb + m * ldc, ldc)
        HM_SWITCH_R(imin(MT, M - m), HM_CALL)
#undef HM_CALL
      }
    } else if (method == M_INT4) {
      const uint8_t* wb = base + int64_t(nb) * 8 * Kd;
      int64_t so = (int64_t(e) * NBT + nb) * (Kd / G) * 16;
      const float* d = W.scale + so;
      const float* z = W.zero ? W.zero + so : nullptr;
      for (int m = 0; m < M; m += MT) {
        if (z) {
#define HM_CALL(r) blk_i4<r, true>(wb, Kd, G, A, m, d, z, Cb + m * ldc, ldc)
          HM_SWITCH_R(imin(MT, M - m), HM_CALL)
#undef HM_CALL
        } else {
#define HM_CALL(r) blk_i4<r, false>(wb, Kd, G, A, m, d, z, Cb + m * ldc, ldc)
          HM_SWITCH_R(imin(MT, M - m), HM_CALL)
#undef HM_CALL
        }
      }
    } else if (method == M_FP8) {
      const uint8_t* wb = base + int64_t(nb) * 16 * Kd;
      const float* sc = W.scale + (int64_t(e) * NBT + nb) * (Kd / G);
      for (int m = 0; m < M; m += MT) {
#define HM_CALL(r) blk_fp8<r, (r <= 4 ? 4 : 2)>(wb, Kd, G, A, m, sc, Cb + m * ldc, ldc)
        HM_SWITCH_R(imin(MT, M - m), HM_CALL)
#undef HM_CALL
      }
    } else {
      const uint8_t* wb = base + int64_t(nb) * 32 * Kd;
      for (int m = 0; m < M; m += MT) {
#define HM_CALL(r) blk_bf16<r>(wb, Kd, A, m, Cb + m * ldc, ldc)
        HM_SWITCH_R(imin(MT, M - m), HM_CALL)
#undef HM_CALL
      }
    }
  }
}

}  // namespace avx512

namespace {
const Kernels kTable512 = {"avx512", avx512::act_row_bytes, avx512::quant_row, avx512::gemm, nullptr};
}
}  // namespace hm

extern "C" const hm::Kernels* hm_kernels_avx512() { return &hm::kTable512; }
