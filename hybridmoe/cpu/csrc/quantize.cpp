// Load-time quantizers (quantize.h): bit-identical to quant.py's torch reference. The arithmetic is
// the reference's, step by step in fp32 (torch's `c / t` is reciprocal(t) * c), rounded half to even
// (the 1.5 * 2^23 trick: exact for |x| < 2^22, and every rounded value here is below 2^8); this unit
// is compiled with -ffp-contract=off so no multiply-add is fused. AVX2 unit (auto-vectorized): the
// entry point runs only on a pool, whose creation checked AVX2.
#include "quantize.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "threadpool.h"

namespace hm {
namespace {

constexpr float kRound = 12582912.0f;  // 1.5 * 2^23

inline float rne(float x) {
  return (x + kRound) - kRound;
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while (!(man & 0x400));
      u = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3FF) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7F800000u | man << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN -> 0x7FC0 (c10::BFloat16)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Source row `row` of expert `e` into out[0, K) as fp32; out[K, Kp) = 0.
void load_row(const HmQuantSrc& s, int e, int row, int Kp, float* out) {
  const int K = s.K;
  if (!s.data) {  // a 32-bit integer hash of (row key, k): stateless per value, so it vectorizes
    const uint32_t key = uint32_t(s.seed * 0x9E3779B97F4A7C15ull >> 32) ^ (uint32_t(e) * 0x85EBCA6Bu) ^
                         (uint32_t(row) * 0xC2B2AE35u);
    const float step = float(s.std * 1.7320508075688772 / 8388608.0);  // a / 2^23
    for (int k = 0; k < K; ++k) {
      uint32_t x = key + uint32_t(k) * 0x9E3779B9u;
      x ^= x >> 16;
      x *= 0x7FEB352Du;
      x ^= x >> 15;
      x *= 0x846CA68Bu;
      x ^= x >> 16;
      out[k] = (float(int32_t(x >> 8)) - 8388607.5f) * step;
    }
  } else {
    const int64_t off = int64_t(e) * s.expert_stride + int64_t(row) * s.row_stride;
    if (s.dtype == 0) {
      std::memcpy(out, static_cast<const float*>(s.data) + off, size_t(K) * 4);
    } else if (s.dtype == 1) {
      const uint16_t* p = static_cast<const uint16_t*>(s.data) + off;
      for (int k = 0; k < K; ++k) out[k] = bf16_to_f32(p[k]);
    } else {
      const uint16_t* p = static_cast<const uint16_t*>(s.data) + off;
      for (int k = 0; k < K; ++k) out[k] = f16_to_f32(p[k]);
    }
  }
  std::fill(out + K, out + Kp, 0.0f);
}

// max |x| (n % 8 == 0: rows are Kp long, groups 32..128): max is exact in any order
inline float amax_of(const float* x, int n) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask), m);
  alignas(32) float v[8];
  _mm256_store_ps(v, m);
  float r = 0.0f;
  for (float f : v) r = f > r ? f : r;
  return r;
}

// torch: amax / 127; where(amax > 0, 127 / clamp_min(amax, 1e-30), 0); round(w * inv).clamp(-127, 127)
void quant_int8_row(const float* w, int Kp, int8_t* q, float& scale, int32_t& wsum) {
  const float amax = amax_of(w, Kp);
  scale = amax / 127.0f;
  const float inv = amax > 0 ? (1.0f / std::max(amax, 1e-30f)) * 127.0f : 0.0f;
  int32_t sum = 0;
  for (int k = 0; k < Kp; ++k) {
    float r = rne(w[k] * inv);
    r = std::min(127.0f, std::max(-127.0f, r));
    const int v = int(r);
    q[k] = int8_t(v);
    sum += v;
  }
  wsum = sum;
}

// symmetric: d = amax / 7, inv = where(d > 0, 1 / clamp_min(d, 1e-30), 0), u = round(g * inv).clamp(-8, 7) + 8
// asymmetric: d = (hi - lo) / 15, inv as above, u = round((g - lo) * inv).clamp(0, 15), m = lo
void quant_int4_group(const float* g, int G, bool sym, uint8_t* u, float& d, float& m) {
  if (sym) {
    d = amax_of(g, G) / 7.0f;
    const float inv = d > 0 ? 1.0f / std::max(d, 1e-30f) : 0.0f;
    for (int k = 0; k < G; ++k) {
      const float r = std::min(7.0f, std::max(-8.0f, rne(g[k] * inv)));
      u[k] = uint8_t(int(r) + 8);
    }
    m = -8.0f * d;
    return;
  }
  __m256 vlo = _mm256_loadu_ps(g), vhi = vlo;  // G % 8 == 0
  for (int k = 8; k < G; k += 8) {
    const __m256 v = _mm256_loadu_ps(g + k);
    vlo = _mm256_min_ps(v, vlo);
    vhi = _mm256_max_ps(v, vhi);
  }
  alignas(32) float l8[8], h8[8];
  _mm256_store_ps(l8, vlo);
  _mm256_store_ps(h8, vhi);
  float lo = l8[0], hi = h8[0];
  for (int k = 1; k < 8; ++k) {
    lo = l8[k] < lo ? l8[k] : lo;
    hi = h8[k] > hi ? h8[k] : hi;
  }
  d = (hi - lo) / 15.0f;
  const float inv = d > 0 ? 1.0f / std::max(d, 1e-30f) : 0.0f;
  for (int k = 0; k < G; ++k) {
    const float r = std::min(15.0f, std::max(0.0f, rne((g[k] - lo) * inv)));
    u[k] = uint8_t(int(r));
  }
  m = lo;
}

// Whether x[0..n) (n % 8 == 0) holds no NaN and no infinity: |x| < inf is false for both.
inline bool all_finite(const float* x, int n) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 inf = _mm256_set1_ps(INFINITY);
  __m256 bad = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8)
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask), inf, _CMP_NLT_UQ));
  return _mm256_movemask_ps(bad) == 0;
}

struct Ctx {
  const HmQuantSrc* s;
  const HmQuantDst* d;
  int64_t units, blocks;
  std::atomic<int64_t> next{0};
  // the first non-finite source row found, as expert * N + row (-1: none). A damaged checkpoint: its
  // NaN would otherwise be dropped by the max of amax_of (maxps returns the other operand) and the row
  // quantized to garbage that looks fine.
  std::atomic<int64_t> bad{-1};
};

// Source row of packed row o (-1: padding).
inline int src_row(const HmQuantSrc& s, int o) {
  if (s.w13_inter > 0) {
    const int I = s.w13_inter, nb = o / 16, j = (nb / 2) * 16 + o % 16;
    return j < I ? (nb % 2 ? I + j : j) : -1;
  }
  return o < s.N ? o : -1;
}

void ph_quantize(int, void* p) {
  Ctx& c = *static_cast<Ctx*>(p);
  const HmQuantSrc& s = *c.s;
  const HmQuantDst& d = *c.d;
  const int Kp = d.Kp;
  std::vector<float> w(size_t(16) * Kp);
  std::vector<uint8_t> q(size_t(16) * Kp);
  for (int64_t u = c.next.fetch_add(1); u < c.units; u = c.next.fetch_add(1)) {
    const int e = int(u / c.blocks), nb = int(u % c.blocks);
    bool finite = true;
    for (int r = 0; r < 16 && finite; ++r) {
      const int row = src_row(s, nb * 16 + r);
      if (row < 0) {
        std::fill(w.data() + size_t(r) * Kp, w.data() + size_t(r + 1) * Kp, 0.0f);
      } else {
        load_row(s, e, row, Kp, w.data() + size_t(r) * Kp);
        if (!all_finite(w.data() + size_t(r) * Kp, Kp)) {
          int64_t none = -1;
          c.bad.compare_exchange_strong(none, int64_t(e) * s.N + row);
          c.next.store(c.units);  // the others stop at their next unit
          finite = false;
        }
      }
    }
    if (!finite) break;
    const int64_t n0 = int64_t(e) * d.Np + int64_t(nb) * 16;  // first row of the block, all experts
    if (d.method == 0) {
      int8_t* qs = reinterpret_cast<int8_t*>(q.data());
      for (int r = 0; r < 16; ++r)
        quant_int8_row(w.data() + size_t(r) * Kp, Kp, qs + size_t(r) * Kp, d.scale[n0 + r], d.wsum[n0 + r]);
      uint8_t* out = static_cast<uint8_t*>(d.data) + n0 * Kp;  // [Kp/4][16][4]
      for (int ks = 0; ks < Kp / 4; ++ks)
        for (int r = 0; r < 16; ++r) std::memcpy(out + (ks * 16 + r) * 4, q.data() + size_t(r) * Kp + ks * 4, 4);
    } else if (d.method == 1) {
      const int G = d.group, ng = Kp / G;
      float* dp = d.scale + n0 * ng;  // [ng][16]
      float* mp = d.zero ? d.zero + n0 * ng : nullptr;
      for (int r = 0; r < 16; ++r)
        for (int g = 0; g < ng; ++g) {
          float dv, mv;
          quant_int4_group(w.data() + size_t(r) * Kp + g * G, G, d.symmetric != 0, q.data() + size_t(r) * Kp + g * G,
                           dv, mv);
          dp[g * 16 + r] = dv;
          if (mp) mp[g * 16 + r] = mv;
        }
      uint8_t* out = static_cast<uint8_t*>(d.data) + n0 * Kp / 2;  // [Kp/8][64]: low nibble step 2c, high 2c+1
      for (int cc = 0; cc < Kp / 8; ++cc)
        for (int x = 0; x < 64; ++x) {
          const uint8_t* row = q.data() + size_t(x / 4) * Kp + x % 4;
          out[cc * 64 + x] = uint8_t(row[cc * 8] | row[cc * 8 + 4] << 4);
        }
    } else {
      uint16_t* out = static_cast<uint16_t*>(d.data) + n0 * Kp;  // [Kp/2][16][2]
      for (int ks = 0; ks < Kp / 2; ++ks)
        for (int r = 0; r < 16; ++r) {
          out[(ks * 16 + r) * 2] = f32_to_bf16(w[size_t(r) * Kp + ks * 2]);
          out[(ks * 16 + r) * 2 + 1] = f32_to_bf16(w[size_t(r) * Kp + ks * 2 + 1]);
        }
    }
  }
}

}  // namespace

const char* quantize_check(const HmQuantSrc& s, const HmQuantDst& d) {
  if (s.E < 0 || s.N < 1 || s.K < 1) return "bad source sizes";
  if (s.dtype < 0 || s.dtype > 2) return "source dtype must be f32, bf16 or f16";
  if (d.method < 0 || d.method > 2) return "method must be AMXINT8, AMXINT4 or BF16";
  if (d.Np % 16 || d.Kp % 8 || d.Kp < s.K) return "padded sizes: Np % 16, Kp % 8 and Kp >= K needed";
  if (s.w13_inter > 0 ? (s.N != 2 * s.w13_inter || d.Np % 32 || d.Np / 2 < s.w13_inter) : d.Np < s.N)
    return "padded rows fewer than the source's";
  if (d.method == 1 && (d.group < 1 || d.Kp % d.group)) return "Kp must be a multiple of the int4 group";
  if (!d.data || (d.method == 0 && (!d.scale || !d.wsum)) || (d.method == 1 && (!d.scale || (!d.symmetric && !d.zero))))
    return "null destination pointer";
  return "";
}

std::string quantize_run(ThreadPool& pool, const HmQuantSrc& s, const HmQuantDst& d) {
  Ctx c;
  c.s = &s;
  c.d = &d;
  c.blocks = d.Np / 16;
  c.units = int64_t(s.E) * c.blocks;
  if (c.units) pool.parallel(ph_quantize, &c);
  const int64_t bad = c.bad.load();
  if (bad < 0) return "";
  return "expert " + std::to_string(bad / s.N) + " row " + std::to_string(bad % s.N) +
         ": NaN or infinite values in the source weights (a damaged checkpoint?)";
}

}  // namespace hm
