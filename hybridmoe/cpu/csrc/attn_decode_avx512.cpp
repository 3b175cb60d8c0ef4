// AttnDecodeKernels::span (attn_decode.h) in AVX-512 (F + BW + VL + BF16), for 1 <= G <= 32 query heads a
// kv head: the "heads in lanes" layout of the AVX2 span_lanes (attn_decode.cpp) at 16 lanes, with the
// scores as bf16 pair dots straight from the cache rows.
//  - scores: lane j of a 16-lane vector is query head j; per position, acc += dpbf16(q pairs [D/2][16],
//    the k row's pair d broadcast): the k row is read as it is in the cache (no conversion), one dot
//    per dimension pair for up to 16 heads. The queries are bf16 values (prep rounds them like torch),
//    so the products are exact and only the fp32 sum order differs from an fp32 dot.
//  - softmax: online, lane-wise over the positions of a block (running max, sum, O rescaled when the
//    max grows), the exp polynomial of the AVX2 unit.
//  - values: O [G][Dp] += p * v, lanes the dimensions: the block's v rows widened to fp32 once, then
//    tiles of 4 heads x 64 dims (16 accumulators) over the block's positions.
// On the 2-core Zen 4 (Hq 32 / Hkv 4 / D 128, KV out of cache) the AVX2 span read ~4-8 GB/s of cache
// per core, bound by its instructions (8-lane fp32 scores after a conversion of every k row);
// benchmarks/bench_cpu_attn.py --kernels compares the two in one process.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "attn_decode.h"

namespace {

using hm::kExpMin, hm::kExpPoly, hm::kLn2Hi, hm::kLn2Lo, hm::kLog2e;

constexpr int kPB = 32;  // positions a block

inline const uint16_t* cache_row(const HmAttnDecode& a, const uint16_t* cache, const int32_t* pages, int64_t l, int g) {
  return cache + ((int64_t(pages[l / a.S]) * a.S + l % a.S) * a.Hkv + g) * a.D;
}

// the k and v rows of head g at position l into L2 (as the AVX2 unit: pages are anywhere in the cache)
inline void prefetch_kv(const HmAttnDecode& a, const int32_t* pages, int64_t l, int g) {
  const char* k = reinterpret_cast<const char*>(cache_row(a, a.k_cache, pages, l, g));
  const char* v = reinterpret_cast<const char*>(cache_row(a, a.v_cache, pages, l, g));
  for (int o = 0; o < 2 * a.D; o += 64) {
    _mm_prefetch(k + o, _MM_HINT_T1);
    _mm_prefetch(v + o, _MM_HINT_T1);
  }
}

// one row of head g at position l of a cache into L2
inline void prefetch_row(const HmAttnDecode& a, const uint16_t* cache, const int32_t* pages, int64_t l, int g) {
  const char* r = reinterpret_cast<const char*>(cache_row(a, cache, pages, l, g));
  for (int o = 0; o < 2 * a.D; o += 64) _mm_prefetch(r + o, _MM_HINT_T1);
}

// exp of 16 lanes (inputs <= 0): the AVX2 unit's exp8 polynomial
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// Scores of NP positions (k rows kr[p]) for the heads of q2 [DH][16 NV] (bf16 pairs): sc [p][16 NV] x scale.
template <int NV, int NP>
inline void score_block(const uint32_t* q2, int DH, const uint16_t* const* kr, float scale, float* sc) {
  __m512 acc[NP][NV];
  for (int p = 0; p < NP; ++p)
    for (int v = 0; v < NV; ++v) acc[p][v] = _mm512_setzero_ps();
  const uint32_t* k32[NP];
  for (int p = 0; p < NP; ++p) k32[p] = reinterpret_cast<const uint32_t*>(kr[p]);
  for (int d = 0; d < DH; ++d) {
    __m512bh q[NV];
    for (int v = 0; v < NV; ++v) q[v] = (__m512bh)_mm512_loadu_si512(q2 + size_t(d) * 16 * NV + 16 * v);
    for (int p = 0; p < NP; ++p) {
      uint32_t kd;
      std::memcpy(&kd, k32[p] + d, 4);
      const __m512bh k = (__m512bh)_mm512_set1_epi32(int(kd));
      for (int v = 0; v < NV; ++v) acc[p][v] = _mm512_dpbf16_ps(acc[p][v], q[v], k);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int p = 0; p < NP; ++p)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(sc + size_t(p) * 16 * NV + 16 * v, _mm512_mul_ps(acc[p][v], s));
}

// o [G][Dp] (heads j0 .. j0 + NJ - 1, dims [d0, d0 + 16 ND)) += sum over the np positions of probs [p][W]
// (lane j: head j) * vf [p][Dp]
template <int NJ, int ND>
inline void value_tile(const float* probs, int W, const float* vf, int np, int Dp, int j0, int d0, float* o) {
  __m512 acc[NJ][ND];
  for (int j = 0; j < NJ; ++j)
    for (int c = 0; c < ND; ++c) acc[j][c] = _mm512_loadu_ps(o + size_t(j0 + j) * Dp + d0 + 16 * c);
  for (int p = 0; p < np; ++p) {
    __m512 v[ND];
    for (int c = 0; c < ND; ++c) v[c] = _mm512_loadu_ps(vf + size_t(p) * Dp + d0 + 16 * c);
    for (int j = 0; j < NJ; ++j) {
      const __m512 pr = _mm512_set1_ps(probs[size_t(p) * W + j0 + j]);
      for (int c = 0; c < ND; ++c) acc[j][c] = _mm512_fmadd_ps(pr, v[c], acc[j][c]);
    }
  }
  for (int j = 0; j < NJ; ++j)
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(o + size_t(j0 + j) * Dp + d0 + 16 * c, acc[j][c]);
}

template <int NJ>
inline void value_heads(const float* probs, int W, const float* vf, int np, int Dp, int j0, float* o) {
  int d = 0;
  for (; d + 64 <= Dp; d += 64) value_tile<NJ, 4>(probs, W, vf, np, Dp, j0, d, o);
  for (; d < Dp; d += 16) value_tile<NJ, 1>(probs, W, vf, np, Dp, j0, d, o);
}

inline void value_all(const float* probs, int W, const float* vf, int np, int Dp, int G, float* o) {
  int j = 0;
  for (; j + 4 <= G; j += 4) value_heads<4>(probs, W, vf, np, Dp, j, o);
  switch (G - j) {
    case 3: value_heads<3>(probs, W, vf, np, Dp, j, o); break;
    case 2: value_heads<2>(probs, W, vf, np, Dp, j, o); break;
    case 1: value_heads<1>(probs, W, vf, np, Dp, j, o); break;
  }
}

// D bf16 -> Dp fp32 (the same values; zeros past D)
inline void row_f32(const uint16_t* r, int D, int Dp, float* out) {
  int i = 0;
  for (; i + 16 <= D; i += 16)
    _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                                  _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + i))), 16)));
  if (i < Dp) {
    const __mmask16 m = __mmask16((1u << (D - i)) - 1);
    _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, r + i)), 16)));
  }
}

thread_local std::vector<uint32_t> tl_q2;
thread_local std::vector<uint16_t> tl_kb;
thread_local std::vector<float> tl_o, tl_vf, tl_sc, tl_state;

template <class T>
inline T* grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

inline uint32_t bf16_bits(float f) {  // f is a bf16 value (prep's queries): its upper half
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u >> 16;
}

// span (attn_decode.h) for G <= 16 NV: kv heads g0 + g (g < Hkv = g1 - g0) of each block in turn.
template <int NV>
void span_lanes(const HmAttnDecode& a, int b, int g0, int g1, const float* q, int64_t l0, int64_t l1, float* st,
                int64_t st_stride) {
  constexpr int W = 16 * NV;       // lanes: heads, padded
  constexpr int PS = 8 / NV;       // positions a score block (8 accumulators)
  const int D = a.D, DH = D / 2, Dp = (D + 15) / 16 * 16, G = a.Hq / a.Hkv, Hkv = g1 - g0;
  const int32_t* pages = a.block_table + int64_t(b) * a.ld_bt;
  uint32_t* q2 = grow(tl_q2, size_t(DH) * W * Hkv);
  float* ot = grow(tl_o, size_t(G) * Dp * Hkv);
  float* vf = grow(tl_vf, size_t(kPB) * Dp);
  float* sc = grow(tl_sc, size_t(kPB) * W);
  uint16_t* kb = grow(tl_kb, size_t(kPB) * D);
  float* state = grow(tl_state, size_t(2 * W) * Hkv);  // per head: [W] max | [W] sum
  for (int g = 0; g < Hkv; ++g)
    for (int d = 0; d < DH; ++d)
      for (int j = 0; j < W; ++j) {
        const float* qj = q + (size_t(g) * G + j) * D;
        q2[(size_t(g) * DH + d) * W + j] = j < G ? bf16_bits(qj[2 * d]) | bf16_bits(qj[2 * d + 1]) << 16 : 0u;
      }
  std::memset(ot, 0, sizeof(float) * size_t(G) * Dp * Hkv);
  for (int g = 0; g < Hkv; ++g)
    for (int j = 0; j < W; ++j) {
      state[g * 2 * W + j] = -INFINITY;
      state[g * 2 * W + W + j] = 0.f;
    }
  for (int64_t l = l0; l < std::min(l1, l0 + kPB); ++l)  // the first block's rows (the loop prefetches the next)
    for (int g = 0; g < Hkv; ++g) prefetch_kv(a, pages, l, g0 + g);
  for (int64_t l = l0; l < l1; l += kPB) {
    const int np = int(std::min<int64_t>(kPB, l1 - l));
    const int npf = int(std::min<int64_t>(kPB, std::max<int64_t>(0, l1 - l - kPB)));  // rows of the next block
    for (int g = 0; g < Hkv; ++g) {
      const uint32_t* qg = q2 + size_t(g) * DH * W;
      float* og = ot + size_t(g) * G * Dp;
      float* mg = state + g * 2 * W;
      // the block's k rows copied in order first (a stream the core runs ahead on; the dots then read
      // them from L1)
      const uint16_t* kr[kPB];
      for (int p = 0; p < np; ++p) {
        if (p < npf) prefetch_row(a, a.k_cache, pages, l + kPB + p, g0 + g);
        std::memcpy(kb + size_t(p) * D, cache_row(a, a.k_cache, pages, l + p, g0 + g), sizeof(uint16_t) * size_t(D));
        kr[p] = kb + size_t(p) * D;
      }
      int p = 0;
      for (; p + PS <= np; p += PS) {
        score_block<NV, PS>(qg, DH, kr + p, a.scale, sc + size_t(p) * W);
      }
      for (; p < np; ++p) {
        score_block<NV, 1>(qg, DH, kr + p, a.scale, sc + size_t(p) * W);
      }
      for (int v = 0; v < NV; ++v) {
        const __m512 old = _mm512_loadu_ps(mg + 16 * v);
        __m512 m = old;
        for (int i = 0; i < np; ++i) m = _mm512_max_ps(m, _mm512_loadu_ps(sc + size_t(i) * W + 16 * v));
        __m512 sum = _mm512_loadu_ps(mg + W + 16 * v);
        if (_mm512_cmp_ps_mask(m, old, _CMP_GT_OQ)) {
          const __m512 r = exp16(_mm512_sub_ps(old, m));  // ~0 where the old max was -inf
          sum = _mm512_mul_ps(sum, r);
          alignas(64) float r16[16];
          _mm512_store_ps(r16, r);
          for (int j = 16 * v; j < std::min(G, 16 * v + 16); ++j) {  // head j's O row times its lane's factor
            const __m512 rj = _mm512_set1_ps(r16[j - 16 * v]);
            float* o = og + size_t(j) * Dp;
            for (int d = 0; d < Dp; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), rj));
          }
          _mm512_storeu_ps(mg + 16 * v, m);
        }
        for (int i = 0; i < np; ++i) {
          float* si = sc + size_t(i) * W + 16 * v;
          const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(si), m));
          _mm512_storeu_ps(si, e);
          sum = _mm512_add_ps(sum, e);
        }
        _mm512_storeu_ps(mg + W + 16 * v, sum);
      }
      for (int i = 0; i < np; ++i) {
        if (i < npf) prefetch_row(a, a.v_cache, pages, l + kPB + i, g0 + g);
        row_f32(cache_row(a, a.v_cache, pages, l + i, g0 + g), D, Dp, vf + size_t(i) * Dp);
      }
      value_all(sc, W, vf, np, Dp, G, og);
    }
  }
  for (int g = 0; g < Hkv; ++g) {
    float* sg = st + g * st_stride;
    const float* mg = state + g * 2 * W;
    const float* og = ot + size_t(g) * G * Dp;
    for (int j = 0; j < G; ++j) {
      sg[j] = mg[j];
      sg[G + j] = mg[W + j];
      std::memcpy(sg + 2 * G + size_t(j) * D, og + size_t(j) * Dp, sizeof(float) * size_t(D));
    }
  }
}

}  // namespace

// The AVX-512 span for G <= 32 (attn_decode.h); false: not for this G (the caller uses the AVX2 span).
extern "C" bool hm_attn_span_avx512(const HmAttnDecode& a, int b, int g0, int g1, const float* q, int64_t l0,
                                    int64_t l1, float* st, int64_t st_stride) {
  const int G = a.Hq / a.Hkv;
  if (G <= 16) span_lanes<1>(a, b, g0, g1, q, l0, l1, st, st_stride);
  else if (G <= 32) span_lanes<2>(a, b, g0, g1, q, l0, l1, st, st_stride);
  else return false;
  return true;
}
