// hm_attn_decode's work (attn_decode.h), AVX2 unit: plain loops the compiler vectorizes. No fp
// contraction (-ffp-contract=off in build.py): the norm and RoPE steps round like torch's ops.
#include "attn_decode.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "dense.h"

namespace hm {
namespace {

inline float bf(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float rb(float f) { return bf(dense_f32_to_bf16(f)); }  // round to bf16 and back

// 8 bf16 -> 8 fp32
inline __m256 ld8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
// rb on 8 lanes: round to bf16 (nearest even, NaN kept quiet: dense_f32_to_bf16) and back
inline __m256 rb8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i hi = _mm256_set1_epi32(int(0xffff0000u));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), hi);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i q = _mm256_or_si256(_mm256_and_si256(u, hi), _mm256_set1_epi32(0x400000));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(r, q, nan));
}

// One head: RMSNorm (when w) then RoPE at position pos, as fused_ops.qk_norm_rope_ref; out: the bf16
// results as floats. The same roundings lane by lane with D a multiple of 16 (the norm's sum in 8
// partial sums), else one value at a time.
void norm_rope(const uint16_t* x, const uint16_t* w, float eps, const float* c, const float* s, int D, float* out) {
  float* xs = out;
  const int h = D / 2;
  if (D % 16 == 0) {
    __m256 ss8 = _mm256_setzero_ps();
    for (int i = 0; i < D; i += 8) {
      const __m256 v = ld8(x + i);
      _mm256_storeu_ps(xs + i, v);
      ss8 = _mm256_add_ps(ss8, _mm256_mul_ps(v, v));
    }
    if (w) {
      const __m256 r = _mm256_set1_ps(1.0f / std::sqrt(hsum(ss8) / float(D) + eps));
      for (int i = 0; i < D; i += 8)
        _mm256_storeu_ps(xs + i, rb8(_mm256_mul_ps(ld8(w + i), rb8(_mm256_mul_ps(_mm256_loadu_ps(xs + i), r)))));
    }
    for (int i = 0; i < h; i += 8) {
      const __m256 cc = rb8(_mm256_loadu_ps(c + i)), sn = rb8(_mm256_loadu_ps(s + i));
      const __m256 x1 = _mm256_loadu_ps(xs + i), x2 = _mm256_loadu_ps(xs + i + h);
      const __m256 nx2 = _mm256_xor_ps(x2, _mm256_set1_ps(-0.0f));
      _mm256_storeu_ps(out + i, rb8(_mm256_add_ps(rb8(_mm256_mul_ps(x1, cc)), rb8(_mm256_mul_ps(nx2, sn)))));
      _mm256_storeu_ps(out + i + h, rb8(_mm256_add_ps(rb8(_mm256_mul_ps(x2, cc)), rb8(_mm256_mul_ps(x1, sn)))));
    }
    return;
  }
  for (int i = 0; i < D; ++i) xs[i] = bf(x[i]);
  if (w) {
    float ss = 0.f;
    for (int i = 0; i < D; ++i) ss += xs[i] * xs[i];
    const float r = 1.0f / std::sqrt(ss / float(D) + eps);
    for (int i = 0; i < D; ++i) xs[i] = rb(bf(w[i]) * rb(xs[i] * r));
  }
  float tmp[1024];
  for (int i = 0; i < h; ++i) {
    const float cc = rb(c[i]), sn = rb(s[i]);
    const float x1 = xs[i], x2 = xs[i + h];
    tmp[i] = rb(rb(x1 * cc) + rb(-x2 * sn));
    tmp[i + h] = rb(rb(x2 * cc) + rb(x1 * sn));
  }
  std::memcpy(out, tmp, sizeof(float) * size_t(D));
}

// exp of 8 lanes (inputs <= 0 here: scores minus their max): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2],
// a degree-6 polynomial: within ~2 fp32 ulps of std::exp; below -87 it is 0 (std::exp: denormals).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpMin));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline const uint16_t* cache_row(const HmAttnDecode& a, const uint16_t* cache, const int32_t* pages, int64_t l, int g) {
  return cache + ((int64_t(pages[l / a.S]) * a.S + l % a.S) * a.Hkv + g) * a.D;
}

// The G query heads of group g at sequence b, normed and rotated (fp32: bf16 values), into q [G][D]; the
// new token's k (normed, rotated) and v of head g into the caches.
void prep(const HmAttnDecode& a, int b, int g, float* q) {
  const int D = a.D, G = a.Hq / a.Hkv, h = D / 2;
  const uint16_t* row = a.qkv + int64_t(b) * a.ld_qkv;
  const int64_t pos = a.positions[b];
  const float* c = a.cos + pos * h;
  const float* s = a.sin + pos * h;
  for (int j = 0; j < G; ++j) norm_rope(row + (g * G + j) * D, a.q_norm, a.eps, c, s, D, q + size_t(j) * D);
  float kv[1024];
  norm_rope(row + (a.Hq + g) * D, a.k_norm, a.eps, c, s, D, kv);
  const int64_t slot = a.slots[b];
  uint16_t* kd = a.k_cache + (slot * a.Hkv + g) * D;
  for (int i = 0; i < D; ++i) kd[i] = dense_f32_to_bf16(kv[i]);  // exact: the values are bf16
  std::memcpy(a.v_cache + (slot * a.Hkv + g) * D, row + (a.Hq + a.Hkv + g) * D, sizeof(uint16_t) * size_t(D));
}

// Scores of NB (<= 8) query heads against cached keys [l0, l1), times scale, into sc [NB][n].
template <int NB>
void scores(const HmAttnDecode& a, const int32_t* pages, int g, const float* q, int64_t l0, int64_t l1, float* sc,
            int64_t n) {
  const int D = a.D, D8 = D / 8 * 8;
  for (int64_t l = l0; l < l1; ++l) {
    const uint16_t* kr = cache_row(a, a.k_cache, pages, l, g);
    __m256 acc[NB];
    for (int j = 0; j < NB; ++j) acc[j] = _mm256_setzero_ps();
    for (int i = 0; i < D8; i += 8) {
      const __m256 k8 = ld8(kr + i);
      for (int j = 0; j < NB; ++j) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + size_t(j) * D + i), k8, acc[j]);
    }
    for (int j = 0; j < NB; ++j) {
      float d = hsum(acc[j]);
      for (int i = D8; i < D; ++i) d += q[size_t(j) * D + i] * bf(kr[i]);
      sc[j * n + (l - l0)] = d * a.scale;
    }
  }
}

// span (below) for G < 4 heads a group: each head's dots along D (horizontal sums), the weighted sum of v
// rows accumulated in memory.
void span_rows(const HmAttnDecode& a, int b, int g, const float* q, int64_t l0, int64_t l1, float* st, float* sc) {
  const int D = a.D, G = a.Hq / a.Hkv, D8 = D / 8 * 8;
  const int32_t* pages = a.block_table + int64_t(b) * a.ld_bt;
  const int64_t n = l1 - l0;
  for (int j0 = 0; j0 < G; j0 += 8) {
    const float* qj = q + size_t(j0) * D;
    float* sj = sc + j0 * n;
    switch (std::min(8, G - j0)) {
      case 1: scores<1>(a, pages, g, qj, l0, l1, sj, n); break;
      case 2: scores<2>(a, pages, g, qj, l0, l1, sj, n); break;
      case 3: scores<3>(a, pages, g, qj, l0, l1, sj, n); break;
      case 4: scores<4>(a, pages, g, qj, l0, l1, sj, n); break;
      case 5: scores<5>(a, pages, g, qj, l0, l1, sj, n); break;
      case 6: scores<6>(a, pages, g, qj, l0, l1, sj, n); break;
      case 7: scores<7>(a, pages, g, qj, l0, l1, sj, n); break;
      default: scores<8>(a, pages, g, qj, l0, l1, sj, n); break;
    }
  }
  float* mx = st;
  float* sum = st + G;
  float* acc = st + 2 * G;
  for (int j = 0; j < G; ++j) {
    float* s = sc + j * n;
    float m = -INFINITY;
    for (int64_t l = 0; l < n; ++l) m = std::max(m, s[l]);
    __m256 s8 = _mm256_setzero_ps();
    const __m256 m8 = _mm256_set1_ps(m);
    int64_t l = 0;
    for (; l + 8 <= n; l += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + l), m8));
      _mm256_storeu_ps(s + l, e);
      s8 = _mm256_add_ps(s8, e);
    }
    float t = hsum(s8);
    for (; l < n; ++l) t += (s[l] = std::exp(s[l] - m));
    mx[j] = m;
    sum[j] = t;
    std::memset(acc + size_t(j) * D, 0, sizeof(float) * size_t(D));
  }
  for (int64_t l = l0; l < l1; ++l) {
    const uint16_t* vr = cache_row(a, a.v_cache, pages, l, g);
    for (int i = 0; i < D8; i += 8) {
      const __m256 v8 = ld8(vr + i);
      for (int j = 0; j < G; ++j) {
        float* o = acc + size_t(j) * D + i;
        _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_set1_ps(sc[j * n + (l - l0)]), v8, _mm256_loadu_ps(o)));
      }
    }
    for (int i = D8; i < D; ++i)
      for (int j = 0; j < G; ++j) acc[size_t(j) * D + i] += sc[j * n + (l - l0)] * bf(vr[i]);
  }
}

// span for 4 <= G <= 16 heads a group ("heads in lanes"): the G heads are the lanes of NV 8-float
// vectors (lanes >= G: zero queries, never output). Per position that makes one vector of G scores
// with no horizontal sums (Q^T [D][8 NV] times the cached k value of one (position, dim) broadcast),
// and the softmax is lane-wise over positions. The values go the other way round: O [G][D] += p * v,
// the v row's 8-dim vectors straight from bf16 times one head's probability broadcast (value_heads).
// The k rows are converted to fp32 once per block of positions, and the next block's rows are
// prefetched into L2 a few lines at a time (L1 is too small to keep them beside Q^T and O). Every dot
// and sum runs in ascending order of d and of the positions.
// On the 2-core Zen 4, one thread, Hq 32 / Hkv 4 / D 128, KV out of cache: 5.6-6.5 GB/s of cache read
// against 1.0-1.3 for span_rows over one kv head a unit (benchmarks/bench_cpu_attn.py --cold --libs);
// 13.5 GB/s on 2 threads at 16K positions against 2.4. (v in bf16 in the value pass, not converted
// like k: 5-10% faster, bit-identical.)
constexpr int kPB = 32;  // positions per block of converted rows (16: 5-10% slower, 8: 10%)

thread_local std::vector<float> tl_qt, tl_ot, tl_rows;

inline float* grow(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// The k and v rows of heads [g0, g1) of positions [l, l + n) into L2 (prefetcht1): a span's first block.
inline void prefetch_rows(const HmAttnDecode& a, const int32_t* pages, int64_t l, int64_t n, int g0, int g1) {
  const int64_t bytes = int64_t(2) * a.D * (g1 - g0);
  for (int64_t i = l; i < l + n; ++i) {
    const char* k = reinterpret_cast<const char*>(cache_row(a, a.k_cache, pages, i, g0));
    const char* v = reinterpret_cast<const char*>(cache_row(a, a.v_cache, pages, i, g0));
    for (int64_t o = 0; o < bytes; o += 64) {
      _mm_prefetch(k + o, _MM_HINT_T1);
      _mm_prefetch(v + o, _MM_HINT_T1);
    }
  }
}

// Head g's row of position l of a cache into L2 (prefetcht1): the pages of a sequence are anywhere in
// the cache, so the hardware prefetchers lose the stream at every page. (Into L1, prefetcht0, it read
// 1.45x slower: evicted before use.)
inline void prefetch_head(const HmAttnDecode& a, const uint16_t* cache, const int32_t* pages, int64_t l, int g) {
  const char* r = reinterpret_cast<const char*>(cache_row(a, cache, pages, l, g));
  for (int o = 0; o < 2 * a.D; o += 64) _mm_prefetch(r + o, _MM_HINT_T1);
}

// D bf16 -> fp32 (the same values)
inline void row_f32(const uint16_t* r, int D, float* out) {
  const int D8 = D / 8 * 8;
  for (int i = 0; i < D8; i += 8) _mm256_storeu_ps(out + i, ld8(r + i));
  for (int i = D8; i < D; ++i) out[i] = bf(r[i]);
}

// Scores of NP positions (rows kf [NP][D]) for the heads of qt [D][8 NV]: sc [NP][8 NV], times scale.
template <int NV, int NP>
inline void score_block(const float* qt, const float* kf, int D, float scale, float* sc) {
  __m256 acc[NP][NV];
  for (int p = 0; p < NP; ++p)
    for (int v = 0; v < NV; ++v) acc[p][v] = _mm256_setzero_ps();
  for (int d = 0; d < D; ++d) {
    __m256 q[NV];
    for (int v = 0; v < NV; ++v) q[v] = _mm256_loadu_ps(qt + size_t(d) * 8 * NV + 8 * v);
    for (int p = 0; p < NP; ++p) {
      const __m256 k = _mm256_broadcast_ss(kf + size_t(p) * D + d);
      for (int v = 0; v < NV; ++v) acc[p][v] = _mm256_fmadd_ps(k, q[v], acc[p][v]);
    }
  }
  const __m256 s8 = _mm256_set1_ps(scale);
  for (int p = 0; p < NP; ++p)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(sc + size_t(p) * 8 * NV + 8 * v, _mm256_mul_ps(acc[p][v], s8));
}

// o [G][D] (heads j0 .. j0 + NJ - 1) += sum over the np positions of probs [p][W] (lane j: head j) * v [p][D]
// (the bf16 rows vr[p]), 16 dims a tile: per position two 8-dim v vectors and one broadcast probability a
// head. The same products and sums, in the same order, as on O^T [D][W] with the lanes the heads.
template <int NJ>
inline void value_heads(const float* probs, int W, const uint16_t* const* vr, int np, int D, int j0, float* o) {
  int d = 0;
  for (; d + 16 <= D; d += 16) {
    __m256 acc[NJ][2];
    for (int j = 0; j < NJ; ++j)
      for (int c = 0; c < 2; ++c) acc[j][c] = _mm256_loadu_ps(o + size_t(j0 + j) * D + d + 8 * c);
    for (int p = 0; p < np; ++p) {
      const __m256 v0 = ld8(vr[p] + d), v1 = ld8(vr[p] + d + 8);
      for (int j = 0; j < NJ; ++j) {
        const __m256 pr = _mm256_broadcast_ss(probs + size_t(p) * W + j0 + j);
        acc[j][0] = _mm256_fmadd_ps(pr, v0, acc[j][0]);
        acc[j][1] = _mm256_fmadd_ps(pr, v1, acc[j][1]);
      }
    }
    for (int j = 0; j < NJ; ++j)
      for (int c = 0; c < 2; ++c) _mm256_storeu_ps(o + size_t(j0 + j) * D + d + 8 * c, acc[j][c]);
  }
  for (; d + 8 <= D; d += 8) {
    __m256 acc[NJ];
    for (int j = 0; j < NJ; ++j) acc[j] = _mm256_loadu_ps(o + size_t(j0 + j) * D + d);
    for (int p = 0; p < np; ++p) {
      const __m256 v0 = ld8(vr[p] + d);
      for (int j = 0; j < NJ; ++j)
        acc[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(probs + size_t(p) * W + j0 + j), v0, acc[j]);
    }
    for (int j = 0; j < NJ; ++j) _mm256_storeu_ps(o + size_t(j0 + j) * D + d, acc[j]);
  }
  for (; d < D; ++d)
    for (int j = 0; j < NJ; ++j) {
      float x = o[size_t(j0 + j) * D + d];
      for (int p = 0; p < np; ++p) x = std::fma(probs[size_t(p) * W + j0 + j], bf(vr[p][d]), x);
      o[size_t(j0 + j) * D + d] = x;
    }
}

// value_heads for the G heads, four at a time.
inline void value_all(const float* probs, int W, const uint16_t* const* vr, int np, int D, int G, float* o) {
  int j = 0;
  for (; j + 4 <= G; j += 4) value_heads<4>(probs, W, vr, np, D, j, o);
  switch (G - j) {
    case 3: value_heads<3>(probs, W, vr, np, D, j, o); break;
    case 2: value_heads<2>(probs, W, vr, np, D, j, o); break;
    case 1: value_heads<1>(probs, W, vr, np, D, j, o); break;
  }
}

thread_local std::vector<float> tl_state;

// span for 4 <= G <= 16 (module comment above), kv heads g0 + g (g < Hkv = g1 - g0) of the block in
// turn: head g's queries qt + g * D * W, running O ot + g * D * W ([G][D] used), max and sum state + g * 2W.
template <int NV>
void span_lanes(const HmAttnDecode& a, int b, int g0, int g1, const float* q, int64_t l0, int64_t l1, float* st,
                int64_t st_stride, float* sc) {
  constexpr int W = 8 * NV;         // lanes: heads, padded
  constexpr int PS = 8 / NV;        // positions a score block
  const int D = a.D, G = a.Hq / a.Hkv, Hkv = g1 - g0;
  const size_t DW = size_t(D) * W;
  const int32_t* pages = a.block_table + int64_t(b) * a.ld_bt;
  float* qt = grow(tl_qt, DW * Hkv);
  float* ot = grow(tl_ot, DW * Hkv);
  float* rows = grow(tl_rows, size_t(kPB) * D);
  float* state = grow(tl_state, size_t(2 * W) * Hkv);  // per head: [W] max | [W] sum
  for (int g = 0; g < Hkv; ++g)
    for (int d = 0; d < D; ++d)
      for (int j = 0; j < W; ++j) qt[g * DW + size_t(d) * W + j] = j < G ? q[(size_t(g) * G + j) * D + d] : 0.f;
  std::memset(ot, 0, sizeof(float) * DW * Hkv);
  for (int g = 0; g < Hkv; ++g)
    for (int j = 0; j < W; ++j) {
      state[g * 2 * W + j] = -INFINITY;
      state[g * 2 * W + W + j] = 0.f;
    }
  // one pass over blocks of positions with each lane's running max, sum and O (online softmax): a
  // block's scores, its exps at the running max (the sum and O rescaled when the max grows), its
  // values; sc holds one block's [kPB][W] scores.
  prefetch_rows(a, pages, l0, std::min<int64_t>(kPB, l1 - l0), g0, g1);
  for (int64_t l = l0; l < l1; l += kPB) {
    const int np = int(std::min<int64_t>(kPB, l1 - l));
    const int npf = int(std::min<int64_t>(kPB, std::max<int64_t>(0, l1 - l - kPB)));  // rows of the next block
    for (int g = 0; g < Hkv; ++g) {
      const float* qg = qt + g * DW;
      float* og = ot + g * DW;
      float* mg = state + g * 2 * W;
      for (int p = 0; p < np; ++p) {
        // the next block's rows of this head, a few lines at a time between the conversions (a burst of a
        // whole block's prefetches fills the miss buffers and stalls the core: 13% slower)
        if (p < npf) {
          prefetch_head(a, a.k_cache, pages, l + kPB + p, g0 + g);
          prefetch_head(a, a.v_cache, pages, l + kPB + p, g0 + g);
        }
        row_f32(cache_row(a, a.k_cache, pages, l + p, g0 + g), D, rows + size_t(p) * D);
      }
      int p = 0;
      for (; p + PS <= np; p += PS) score_block<NV, PS>(qg, rows + size_t(p) * D, D, a.scale, sc + size_t(p) * W);
      for (; p < np; ++p) score_block<NV, 1>(qg, rows + size_t(p) * D, D, a.scale, sc + size_t(p) * W);
      for (int v = 0; v < NV; ++v) {
        const __m256 old = _mm256_loadu_ps(mg + 8 * v);
        __m256 m = old;
        for (int i = 0; i < np; ++i) m = _mm256_max_ps(m, _mm256_loadu_ps(sc + size_t(i) * W + 8 * v));
        __m256 sum = _mm256_loadu_ps(mg + W + 8 * v);
        if (_mm256_movemask_ps(_mm256_cmp_ps(m, old, _CMP_GT_OQ))) {
          const __m256 r = exp8(_mm256_sub_ps(old, m));  // ~0 where the old max was -inf (exp8 clamps: x 0 anyway)
          sum = _mm256_mul_ps(sum, r);
          alignas(32) float r8[8];
          _mm256_store_ps(r8, r);
          for (int j = 8 * v; j < std::min(G, 8 * v + 8); ++j) {  // head j's O row times its lane's factor
            const __m256 rj = _mm256_set1_ps(r8[j - 8 * v]);
            float* o = og + size_t(j) * D;
            int d = 0;
            for (; d + 8 <= D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), rj));
            for (; d < D; ++d) o[d] *= r8[j - 8 * v];
          }
          _mm256_storeu_ps(mg + 8 * v, m);
        }
        for (int i = 0; i < np; ++i) {
          float* si = sc + size_t(i) * W + 8 * v;
          const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(si), m));
          _mm256_storeu_ps(si, e);
          sum = _mm256_add_ps(sum, e);
        }
        _mm256_storeu_ps(mg + W + 8 * v, sum);
      }
      const uint16_t* vr[kPB];
      for (int i = 0; i < np; ++i) vr[i] = cache_row(a, a.v_cache, pages, l + i, g0 + g);
      value_all(sc, W, vr, np, D, G, og);
    }
  }
  for (int g = 0; g < Hkv; ++g) {
    float* sg = st + g * st_stride;
    const float* mg = state + g * 2 * W;
    const float* og = ot + g * DW;
    for (int j = 0; j < G; ++j) {
      sg[j] = mg[j];
      sg[G + j] = mg[W + j];
      std::memcpy(sg + 2 * G + size_t(j) * D, og + size_t(j) * D, sizeof(float) * size_t(D));
    }
  }
}

// AttnDecodeKernels::span (attn_decode.h): the heads-in-lanes kernel for 4 <= G <= 16, else each kv head
// in turn with span_rows.
void span(const HmAttnDecode& a, int b, int g0, int g1, const float* q, int64_t l0, int64_t l1, float* st,
          int64_t st_stride, float* sc) {
  const int G = a.Hq / a.Hkv;
  if (G >= 4 && G <= 8) return span_lanes<1>(a, b, g0, g1, q, l0, l1, st, st_stride, sc);
  if (G > 8 && G <= 16) return span_lanes<2>(a, b, g0, g1, q, l0, l1, st, st_stride, sc);
  for (int g = g0; g < g1; ++g)
    span_rows(a, b, g, q + size_t(g - g0) * G * a.D, l0, l1, st + (g - g0) * st_stride, sc);
}

// The bf16 output of group g's heads at sequence b from `ns` span states (span's layout, st_stride floats apart).
void finish(const HmAttnDecode& a, int b, int g, const float* st, int ns, int64_t st_stride) {
  const int D = a.D, G = a.Hq / a.Hkv;
  for (int j = 0; j < G; ++j) {
    float m = -INFINITY;
    for (int c = 0; c < ns; ++c) m = std::max(m, st[c * st_stride + j]);
    float out[1024] = {};
    float tot = 0.f;
    for (int c = 0; c < ns; ++c) {
      const float* sc = st + c * st_stride;
      const float w = ns == 1 ? 1.0f : std::exp(sc[j] - m);
      tot += w * sc[G + j];
      const float* acc = sc + 2 * G + size_t(j) * D;
      for (int i = 0; i < D; ++i) out[i] += w * acc[i];
    }
    const float r = 1.0f / tot;
    uint16_t* o = a.out + int64_t(b) * a.ld_out + int64_t(g * G + j) * D;
    for (int i = 0; i < D; ++i) o[i] = dense_f32_to_bf16(out[i] * r);
  }
}

const AttnDecodeKernels kAvx2{&prep, &span, &finish};

}  // namespace
}  // namespace hm

extern "C" const hm::AttnDecodeKernels* hm_attn_decode_kernels_avx2() { return &hm::kAvx2; }


// Greedy sampling's argmax over bf16 rows with torch.argmax's answer: the first index of the
// maximum, NaN counting as above everything (the first NaN wins), -0 equal to +0. Integer keys
// (order-preserving, so the max reduction vectorizes): |x| bits for x >= 0, minus them for x < 0,
// 32768 for NaN.
namespace {
inline int32_t key_of(uint16_t b) {
  const int32_t mag = b & 0x7fff;
  return mag > 0x7f80 ? 32768 : ((b & 0x8000) ? -mag : mag);
}
}  // namespace

// nonfinite_key: rows whose maximum key is at least this (key_of: 0x7f80 is +inf, NaN is above it) get
// out = nonfinite instead of the index (INT32_MAX: never).
extern "C" void hm_argmax_bf16_avx2(const uint16_t* x, int64_t n, int64_t rows, int64_t ld, int64_t* out,
                                    int32_t nonfinite_key, int64_t nonfinite) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* p = x + r * ld;
    int32_t best = INT32_MIN;
    int64_t i = 0;
    if (n >= 8) {  // 8 keys at a time: the same key_of, in AVX2
      const __m256i m7 = _mm256_set1_epi32(0x7fff), sgn = _mm256_set1_epi32(0x8000), inf = _mm256_set1_epi32(0x7f80),
                    nan = _mm256_set1_epi32(32768);
      __m256i b8 = _mm256_set1_epi32(INT32_MIN);
      for (; i + 8 <= n; i += 8) {
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
        const __m256i mag = _mm256_and_si256(v, m7);
        const __m256i neg = _mm256_cmpeq_epi32(_mm256_and_si256(v, sgn), sgn);  // all ones where x < 0
        __m256i k = _mm256_sub_epi32(_mm256_xor_si256(mag, neg), neg);            // -mag there, else mag
        k = _mm256_blendv_epi8(k, nan, _mm256_cmpgt_epi32(mag, inf));
        b8 = _mm256_max_epi32(b8, k);
      }
      alignas(32) int32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), b8);
      for (int j = 0; j < 8; ++j) best = std::max(best, lanes[j]);
    }
    for (; i < n; ++i) best = std::max(best, key_of(p[i]));
    int64_t at = 0;
    while (at < n && key_of(p[at]) != best) ++at;
    out[r] = best >= nonfinite_key ? nonfinite : at;
  }
}

// RMSNorm of bf16 rows with the residual add first, rounding where fused_ops.add_rmsnorm_ref does:
// h = bf16(x + res) (written to res_out), normed = bf16(h * rsqrt(mean(h^2) + eps)), out = bf16(w * normed).
// res == nullptr: no add (res_out unused). fp32 sums in this loop's order (torch's may differ in the
// last bits of the mean).
extern "C" void hm_add_rmsnorm_avx2(const uint16_t* x, const uint16_t* res, const uint16_t* w, int64_t rows, int64_t H,
                                    float eps, uint16_t* out, uint16_t* res_out) {
  using hm::dense_f32_to_bf16;
  std::vector<float> h(static_cast<size_t>(H));
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* xr = x + r * H;
    float ss = 0.f;
    for (int64_t i = 0; i < H; ++i) {
      float v = hm::bf(xr[i]);
      if (res) {
        const uint16_t s = dense_f32_to_bf16(v + hm::bf(res[r * H + i]));
        res_out[r * H + i] = s;
        v = hm::bf(s);
      }
      h[size_t(i)] = v;
      ss += v * v;
    }
    const float rs = 1.0f / std::sqrt(ss / float(H) + eps);
    for (int64_t i = 0; i < H; ++i) out[r * H + i] = dense_f32_to_bf16(hm::bf(w[i]) * hm::rb(h[size_t(i)] * rs));
  }
}
