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

// One head: RMSNorm (when w) then RoPE at position pos, as fused_ops.qk_norm_rope_ref; out: the bf16
// results as floats.
void norm_rope(const uint16_t* x, const uint16_t* w, float eps, const float* c, const float* s, int D, float* out) {
  float* xs = out;
  for (int i = 0; i < D; ++i) xs[i] = bf(x[i]);
  if (w) {
    float ss = 0.f;
    for (int i = 0; i < D; ++i) ss += xs[i] * xs[i];
    const float r = 1.0f / std::sqrt(ss / float(D) + eps);
    for (int i = 0; i < D; ++i) xs[i] = rb(bf(w[i]) * rb(xs[i] * r));
  }
  const int h = D / 2;
  float tmp[1024];
  for (int i = 0; i < h; ++i) {
    const float cc = rb(c[i]), sn = rb(s[i]);
    const float x1 = xs[i], x2 = xs[i + h];
    tmp[i] = rb(rb(x1 * cc) + rb(-x2 * sn));
    tmp[i + h] = rb(rb(x2 * cc) + rb(x1 * sn));
  }
  std::memcpy(out, tmp, sizeof(float) * size_t(D));
}

void run(const HmAttnDecode& a) {
  const int D = a.D, Hq = a.Hq, Hkv = a.Hkv, G = Hq / Hkv, h = D / 2;
  const size_t nd = static_cast<size_t>(D);
  std::vector<float> q(static_cast<size_t>(Hq) * nd), kv(nd), sc, acc(nd);
  for (int b = 0; b < a.B; ++b) {
    const uint16_t* row = a.qkv + int64_t(b) * a.ld_qkv;
    const int64_t pos = a.positions[b];
    const float* c = a.cos + pos * h;
    const float* s = a.sin + pos * h;
    for (int hh = 0; hh < Hq; ++hh) norm_rope(row + hh * D, a.q_norm, a.eps, c, s, D, &q[size_t(hh) * D]);
    const int64_t slot = a.slots[b];
    for (int g = 0; g < Hkv; ++g) {
      norm_rope(row + (Hq + g) * D, a.k_norm, a.eps, c, s, D, kv.data());
      uint16_t* kd = a.k_cache + (slot * Hkv + g) * D;
      for (int i = 0; i < D; ++i) kd[i] = dense_f32_to_bf16(kv[i]);  // exact: the values are bf16
      std::memcpy(a.v_cache + (slot * Hkv + g) * D, row + (Hq + Hkv + g) * D, sizeof(uint16_t) * size_t(D));
    }
    const int L = a.seq_lens[b];
    const int32_t* pages = a.block_table + int64_t(b) * a.ld_bt;
    sc.resize(size_t(L));
    for (int hh = 0; hh < Hq; ++hh) {
      const int g = hh / G;
      const float* qh = &q[size_t(hh) * D];
      float mx = -INFINITY;
      for (int l = 0; l < L; ++l) {
        const uint16_t* kr = a.k_cache + ((int64_t(pages[l / a.S]) * a.S + l % a.S) * Hkv + g) * D;
        float d = 0.f;
        for (int i = 0; i < D; ++i) d += qh[i] * bf(kr[i]);
        sc[l] = d * a.scale;
        mx = std::max(mx, sc[l]);
      }
      float sum = 0.f;
      for (int l = 0; l < L; ++l) sum += (sc[l] = std::exp(sc[l] - mx));
      for (int i = 0; i < D; ++i) acc[i] = 0.f;
      for (int l = 0; l < L; ++l) {
        const float p = sc[l] / sum;
        const uint16_t* vr = a.v_cache + ((int64_t(pages[l / a.S]) * a.S + l % a.S) * Hkv + g) * D;
        for (int i = 0; i < D; ++i) acc[i] += p * bf(vr[i]);
      }
      uint16_t* o = a.out + int64_t(b) * a.ld_out + int64_t(hh) * D;
      for (int i = 0; i < D; ++i) o[i] = dense_f32_to_bf16(acc[i]);
    }
  }
}

}  // namespace
}  // namespace hm

extern "C" hm::AttnDecodeFn hm_attn_decode_avx2() { return &hm::run; }

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

extern "C" void hm_argmax_bf16_avx2(const uint16_t* x, int64_t n, int64_t rows, int64_t ld, int64_t* out) {
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
    out[r] = at;
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
