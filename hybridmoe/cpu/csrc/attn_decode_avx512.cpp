// AttnDecodeKernels::span (attn_decode.h) in AVX-512 (F + BW + VL + BF16), for 1 <= G <= 32 query heads a
// kv head: the "heads in lanes" layout of the AVX2 span_lanes (attn_decode.cpp) at 16 lanes, with the
// scores as bf16 pair dots.
//  - scores: lane j * P + s of a 16-lane vector is query head j at position s of a group of P positions
//    (P = 4 for G <= 4, 2 for G <= 8, else 1: no lane idle for want of heads); per group and dimension
//    pair, one vdpbf16ps of the queries' pairs against the P positions' k pairs repeated over the heads
//    (one broadcast load: the block's k rows are first packed so that those P pairs are adjacent). The
//    queries are bf16 values (prep rounds them like torch), so the products are exact and only the fp32
//    sum order differs from an fp32 dot.
//  - softmax: online, lane-wise over the groups of a block (running max, equal over a head's P lanes;
//    sums per lane, added up at the end; O rescaled when the max grows), the AVX2 unit's exp polynomial.
//  - values: O [G][Dp] += p * v, lanes the dimensions: the block's v rows widened to fp32 once, then
//    tiles of 4 heads x 64 dims (16 accumulators) over the block's positions, in fp32 as the AVX2 unit.
// On the 2-core Zen 4 (Hq 32 / Hkv 4 / D 128) it reads 1.2-1.3x the AVX2 span's rate at 4K-16K positions
// (benchmarks/bench_cpu_attn.py --kernels avx2,avx512). Zen 4 runs a 512-bit FMA as two 256-bit halves,
// so the value pass costs what the AVX2 one does there; cores with two 512-bit FMA units halve it.
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

// The k rows of a group of P positions (rows[s], nullptr: zeros) as DHp storage pairs of P dwords each: out
// [t][s] = pair perm_P(t) of row s (perm_P: the order the unpacks leave, same in every 16-pair chunk; the
// queries are stored in the same order, and a dot does not care which). DHp: DH rounded up to 16.
template <int P>
inline void pack_group(const uint16_t* const* rows, int DH, int DHp, uint32_t* out) {
  for (int c = 0; c < DHp; c += 16) {
    const __mmask16 m = DH - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (DH - c)) - 1);
    __m512i r[P];
    for (int i = 0; i < P; ++i)
      r[i] = rows[i] ? _mm512_maskz_loadu_epi32(m, reinterpret_cast<const uint32_t*>(rows[i]) + c) : _mm512_setzero_si512();
    uint32_t* o = out + size_t(c) * P;
    if constexpr (P == 1) {
      _mm512_storeu_si512(o, r[0]);
    } else if constexpr (P == 2) {
      _mm512_storeu_si512(o, _mm512_unpacklo_epi32(r[0], r[1]));
      _mm512_storeu_si512(o + 16, _mm512_unpackhi_epi32(r[0], r[1]));
    } else {
      const __m512i ablo = _mm512_unpacklo_epi32(r[0], r[1]), abhi = _mm512_unpackhi_epi32(r[0], r[1]);
      const __m512i cdlo = _mm512_unpacklo_epi32(r[2], r[3]), cdhi = _mm512_unpackhi_epi32(r[2], r[3]);
      _mm512_storeu_si512(o, _mm512_unpacklo_epi64(ablo, cdlo));
      _mm512_storeu_si512(o + 16, _mm512_unpackhi_epi64(ablo, cdlo));
      _mm512_storeu_si512(o + 32, _mm512_unpacklo_epi64(abhi, cdhi));
      _mm512_storeu_si512(o + 48, _mm512_unpackhi_epi64(abhi, cdhi));
    }
  }
}

// perm_P of pack_group over one 16-pair chunk, found by packing rows whose pair i holds i
template <int P>
struct PackPerm {
  int t[16];
  PackPerm() {
    alignas(64) uint16_t row[32];
    for (int i = 0; i < 16; ++i) row[2 * i] = uint16_t(i), row[2 * i + 1] = 0;
    const uint16_t* rows[P];
    for (int i = 0; i < P; ++i) rows[i] = row;
    alignas(64) uint32_t out[16 * P];
    pack_group<P>(rows, 16, 16, out);
    for (int i = 0; i < 16; ++i) t[i] = int(out[i * P]);
  }
};

// P dwords (one storage pair of a group) repeated over 16 lanes: lane j * P + s <- dword s
template <int P>
inline __m512bh group_operand(const uint32_t* p) {
  if constexpr (P == 1) return (__m512bh)_mm512_set1_epi32(int(*p));
  else if constexpr (P == 2) return (__m512bh)_mm512_castpd_si512(_mm512_set1_pd(*reinterpret_cast<const double*>(p)));
  else return (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Scores of NG groups of P positions (kg [NG][DHp][P] from pack_group) for the queries q2 [DHp][16 NV]
// (lane j * P + s: head j): sc [group][16 NV] (lane j * P + s: head j at the group's position s) x scale.
template <int NV, int P, int NG>
inline void score_block(const uint32_t* q2, int DHp, const uint32_t* kg, float scale, float* sc) {
  __m512 acc[NG][NV];
  for (int i = 0; i < NG; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int d = 0; d < DHp; ++d) {
    __m512bh q[NV];
    for (int v = 0; v < NV; ++v) q[v] = (__m512bh)_mm512_loadu_si512(q2 + size_t(d) * 16 * NV + 16 * v);
    for (int i = 0; i < NG; ++i) {
      const __m512bh k = group_operand<P>(kg + (size_t(i) * DHp + d) * P);
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], q[v], k);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int i = 0; i < NG; ++i)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(sc + size_t(i) * 16 * NV + 16 * v, _mm512_mul_ps(acc[i][v], s));
}

// o [G][Dp] (heads j0 .. j0 + NJ - 1, dims [d0, d0 + 16 ND)) += sum over the np positions p of head j's
// probability (probs [p / P][W], lane j * P + p % P) * vf [p][Dp]
template <int P, int NJ, int ND>
inline void value_tile(const float* probs, int W, const float* vf, int np, int Dp, int j0, int d0, float* o) {
  __m512 acc[NJ][ND];
  for (int j = 0; j < NJ; ++j)
    for (int c = 0; c < ND; ++c) acc[j][c] = _mm512_loadu_ps(o + size_t(j0 + j) * Dp + d0 + 16 * c);
  for (int p = 0; p < np; ++p) {
    __m512 v[ND];
    for (int c = 0; c < ND; ++c) v[c] = _mm512_loadu_ps(vf + size_t(p) * Dp + d0 + 16 * c);
    for (int j = 0; j < NJ; ++j) {
      const __m512 pr = _mm512_set1_ps(probs[size_t(p / P) * W + (j0 + j) * P + p % P]);
      for (int c = 0; c < ND; ++c) acc[j][c] = _mm512_fmadd_ps(pr, v[c], acc[j][c]);
    }
  }
  for (int j = 0; j < NJ; ++j)
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(o + size_t(j0 + j) * Dp + d0 + 16 * c, acc[j][c]);
}

template <int P, int NJ>
inline void value_heads(const float* probs, int W, const float* vf, int np, int Dp, int j0, float* o) {
  int d = 0;
  for (; d + 64 <= Dp; d += 64) value_tile<P, NJ, 4>(probs, W, vf, np, Dp, j0, d, o);
  for (; d < Dp; d += 16) value_tile<P, NJ, 1>(probs, W, vf, np, Dp, j0, d, o);
}

template <int P>
inline void value_all(const float* probs, int W, const float* vf, int np, int Dp, int G, float* o) {
  int j = 0;
  for (; j + 4 <= G; j += 4) value_heads<P, 4>(probs, W, vf, np, Dp, j, o);
  switch (G - j) {
    case 3: value_heads<P, 3>(probs, W, vf, np, Dp, j, o); break;
    case 2: value_heads<P, 2>(probs, W, vf, np, Dp, j, o); break;
    case 1: value_heads<P, 1>(probs, W, vf, np, Dp, j, o); break;
  }
}

// lane-wise max of P adjacent lanes (each head's slots; P divides 4: they share a 128-bit lane), in each
template <int P>
inline __m512 head_max(__m512 m) {
  if constexpr (P >= 2) m = _mm512_max_ps(m, _mm512_permute_ps(m, 0xB1));  // [1 0 3 2]
  if constexpr (P >= 4) m = _mm512_max_ps(m, _mm512_permute_ps(m, 0x4E));  // [2 3 0 1]
  return m;
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
thread_local std::vector<uint32_t> tl_kb;
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

// span (attn_decode.h) for G <= 16 NV / P: kv heads g0 + g (g < Hkv = g1 - g0) of each block in turn. A
// vector's lane j * P + s is query head j at the s-th position of a group of P (P > 1 for G <= 8: no lanes
// idle for want of heads).
template <int NV, int P>
void span_lanes(const HmAttnDecode& a, int b, int g0, int g1, const float* q, int64_t l0, int64_t l1, float* st,
                int64_t st_stride) {
  static_assert(NV == 1 || P == 1, "two lane vectors only for G > 16");
  constexpr int W = 16 * NV;       // lanes
  constexpr int NG = 8 / NV;       // groups a score block (8 accumulators)
  constexpr int NGB = kPB / P;     // groups a block
  static const PackPerm<P> perm;
  const int D = a.D, DH = D / 2, DHp = (DH + 15) / 16 * 16, Dp = (D + 15) / 16 * 16, G = a.Hq / a.Hkv;
  const int Hkv = g1 - g0;
  const int32_t* pages = a.block_table + int64_t(b) * a.ld_bt;
  uint32_t* q2 = grow(tl_q2, size_t(DHp) * W * Hkv);
  float* ot = grow(tl_o, size_t(G) * Dp * Hkv);
  float* vf = grow(tl_vf, size_t(kPB) * Dp);
  float* sc = grow(tl_sc, size_t(NGB) * W);
  uint32_t* kb = grow(tl_kb, size_t(kPB) * DHp);
  float* state = grow(tl_state, size_t(2 * W) * Hkv);  // per head: [W] max (equal over a head's lanes) | [W] sum
  for (int g = 0; g < Hkv; ++g)
    for (int t = 0; t < DHp; ++t) {
      const int d = t / 16 * 16 + perm.t[t % 16];  // the pair held at storage t
      for (int lane = 0; lane < W; ++lane) {
        const int j = lane / P;
        const float* qj = q + (size_t(g) * G + j) * D;
        q2[(size_t(g) * DHp + t) * W + lane] =
            j < G && d < DH ? bf16_bits(qj[2 * d]) | bf16_bits(qj[2 * d + 1]) << 16 : 0u;
      }
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
    const int ng = (np + P - 1) / P;
    const int npf = int(std::min<int64_t>(kPB, std::max<int64_t>(0, l1 - l - kPB)));  // rows of the next block
    for (int g = 0; g < Hkv; ++g) {
      const uint32_t* qg = q2 + size_t(g) * DHp * W;
      float* og = ot + size_t(g) * G * Dp;
      float* mg = state + g * 2 * W;
      // the block's k rows packed in groups first (a stream the core runs ahead on; the dots then read
      // them from L1), prefetching the next block's rows as it goes
      for (int i = 0; i < ng; ++i) {
        const uint16_t* rows[P];
        for (int s = 0; s < P; ++s) {
          const int p = i * P + s;
          if (p < npf) prefetch_row(a, a.k_cache, pages, l + kPB + p, g0 + g);
          rows[s] = p < np ? cache_row(a, a.k_cache, pages, l + p, g0 + g) : nullptr;
        }
        pack_group<P>(rows, DH, DHp, kb + size_t(i) * DHp * P);
      }
      int i = 0;
      for (; i + NG <= ng; i += NG)
        score_block<NV, P, NG>(qg, DHp, kb + size_t(i) * DHp * P, a.scale, sc + size_t(i) * W);
      for (; i < ng; ++i) score_block<NV, P, 1>(qg, DHp, kb + size_t(i) * DHp * P, a.scale, sc + size_t(i) * W);
      // lanes of a last group's missing positions: excluded from the max, probability 0
      __mmask16 last = 0xFFFF;
      if (np % P)
        for (int lane = 0; lane < 16; ++lane)
          if (lane % P >= np % P) last &= __mmask16(~(1u << lane));
      for (int v = 0; v < NV; ++v) {
        const __m512 old = _mm512_loadu_ps(mg + 16 * v);
        __m512 m = old;
        for (int k = 0; k < ng; ++k) {
          const __m512 x = _mm512_loadu_ps(sc + size_t(k) * W + 16 * v);
          m = k + 1 < ng ? _mm512_max_ps(m, x) : _mm512_mask_max_ps(m, last, m, x);
        }
        m = head_max<P>(m);
        __m512 sum = _mm512_loadu_ps(mg + W + 16 * v);
        if (_mm512_cmp_ps_mask(m, old, _CMP_GT_OQ)) {
          const __m512 r = exp16(_mm512_sub_ps(old, m));  // ~0 where the old max was -inf
          sum = _mm512_mul_ps(sum, r);
          alignas(64) float r16[16];
          _mm512_store_ps(r16, r);
          for (int j = 16 * v / P; j < std::min(G, (16 * v + 16) / P); ++j) {  // head j's O row times its factor
            const __m512 rj = _mm512_set1_ps(r16[j * P - 16 * v]);
            float* o = og + size_t(j) * Dp;
            for (int d = 0; d < Dp; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), rj));
          }
          _mm512_storeu_ps(mg + 16 * v, m);
        }
        for (int k = 0; k < ng; ++k) {
          float* si = sc + size_t(k) * W + 16 * v;
          __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(si), m));
          if (k + 1 == ng) e = _mm512_maskz_mov_ps(last, e);
          _mm512_storeu_ps(si, e);
          sum = _mm512_add_ps(sum, e);
        }
        _mm512_storeu_ps(mg + W + 16 * v, sum);
      }
      for (int p = 0; p < np; ++p) {
        if (p < npf) prefetch_row(a, a.v_cache, pages, l + kPB + p, g0 + g);
        row_f32(cache_row(a, a.v_cache, pages, l + p, g0 + g), D, Dp, vf + size_t(p) * Dp);
      }
      value_all<P>(sc, W, vf, np, Dp, G, og);
    }
  }
  for (int g = 0; g < Hkv; ++g) {
    float* sg = st + g * st_stride;
    const float* mg = state + g * 2 * W;
    const float* og = ot + size_t(g) * G * Dp;
    for (int j = 0; j < G; ++j) {
      sg[j] = mg[j * P];
      float sum = 0.f;
      for (int s = 0; s < P; ++s) sum += mg[W + j * P + s];
      sg[G + j] = sum;
      std::memcpy(sg + 2 * G + size_t(j) * D, og + size_t(j) * Dp, sizeof(float) * size_t(D));
    }
  }
}

}  // namespace

// The AVX-512 span for G <= 32 (attn_decode.h); false: not for this G (the caller uses the AVX2 span).
extern "C" bool hm_attn_span_avx512(const HmAttnDecode& a, int b, int g0, int g1, const float* q, int64_t l0,
                                    int64_t l1, float* st, int64_t st_stride) {
  const int G = a.Hq / a.Hkv;
  if (G <= 4) span_lanes<1, 4>(a, b, g0, g1, q, l0, l1, st, st_stride);
  else if (G <= 8) span_lanes<1, 2>(a, b, g0, g1, q, l0, l1, st, st_stride);
  else if (G <= 16) span_lanes<1, 1>(a, b, g0, g1, q, l0, l1, st, st_stride);
  else if (G <= 32) span_lanes<2, 1>(a, b, g0, g1, q, l0, l1, st, st_stride);
  else return false;
  return true;
}
