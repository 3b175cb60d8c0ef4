// Direct GGUF kernels, AVX2 (+FMA, F16C), for few activation rows per expert (decode): as
// gguf_dot512.h, 32 values per register (register c holds values 32c..32c+31 in order).
//  * K-quants (Q4_K, Q5_K, Q6_K): maddubs(u, q) (u <= 63: int16 pairs cannot saturate), madd with
//    the int16 scale of each pair's group, int32 sums per super-block times d * d_act; mins (Q6_K:
//    the -32 offset) through the activation's int16 group sums.
//  * per-32 float scales (Q4_0, Q8_0, IQ4_XS): signed values w (Q4_0: u - 8), the sign trick
//    maddubs(|w|, sign(q, w)) (|w| <= 128: pairs <= 2 * 128 * 127), madd with ones, converted and
//    scaled by the block's float scale. No offsets.
// Included inside an anonymous namespace after gguf_unpack.h; requires hsum8().

inline __m256i ld256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m128i ld128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
// 16 bytes of packed nibbles (low nibble j = value j, high = value 16 + j) -> 32 values in order
inline __m256i nibbles_16(__m128i x) {
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(15));
}

// vpshufb controls: every int16 lane <- scale byte c (of the 8 in each 128-bit lane)
struct alignas(32) Ctl8x8 {
  int8_t v[8][32];
};
constexpr Ctl8x8 kscale_ctl() {
  Ctl8x8 r{};
  for (int c = 0; c < 8; ++c)
    for (int b = 0; b < 32; ++b) r.v[c][b] = int8_t(b & 1 ? -128 : c);
  return r;
}
constexpr Ctl8x8 kKScaleCtl = kscale_ctl();

// k_scales_vec (gguf_unpack.h) on both 128-bit lanes: lane j = the 16-byte head of a super-block.
// Its constants as 32-byte tables (memory operands, no broadcast in the short-row tail groups).
struct alignas(32) KScaleConsts {
  int8_t v[5][32];
};
constexpr KScaleConsts kscale_consts() {
  constexpr int8_t c[5][16] = {{4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15},
                               {-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11},
                               {63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0},
                               {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15},
                               {0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48}};
  KScaleConsts r{};
  for (int k = 0; k < 5; ++k)
    for (int i = 0; i < 32; ++i) r.v[k][i] = c[k][i % 16];
  return r;
}
constexpr KScaleConsts kKSC = kscale_consts();
inline __m256i k_scales_vec256(__m256i h) {
  const __m256i A = _mm256_shuffle_epi8(h, ld256(kKSC.v[0]));
  const __m256i B = _mm256_shuffle_epi8(h, ld256(kKSC.v[1]));
  const __m256i lo = _mm256_and_si256(A, ld256(kKSC.v[2]));
  const __m256i a4 = _mm256_and_si256(_mm256_srli_epi16(A, 4), ld256(kKSC.v[3]));
  const __m256i b2 = _mm256_and_si256(_mm256_srli_epi16(B, 2), ld256(kKSC.v[4]));
  return _mm256_or_si256(_mm256_or_si256(lo, a4), b2);
}

// Q4_K (144 B: d, dmin, 12 scale bytes, qs 128) / Q5_K (176 B: the same with qh 32 before qs), one
// weight row x R activation rows, NB (1 or 2) super-blocks b, b + 1 at p. Register c = sub-block c
// (the low or high nibbles of 32 bytes of qs); its scale reaches the int16 lanes by one vpshufb of
// the broadcast scale bytes. The scale work is shared by the pair, one 128-bit lane each: one
// k_scales_vec, one unpack for the mins (int16, lane j = super-block j, as the activation's per-32
// sums of 2 consecutive super-blocks load), one conversion of the d / dmin pairs. Per sub-block
// and token maddubs, madd, add; per super-block one conversion and fma; per pair and token one
// madd, conversion and fnmadd for the mins (into the same accumulator).
template <bool Q5, int R, int NB>
inline void kgroup45(const uint8_t* p, int b, const ActRows<R>& a, __m256* acc, int64_t pf) {
  constexpr int kBytes = Q5 ? 176 : 144;
  prefetch_sb<NB * kBytes>(p, pf);
  const __m128i h0 = ld128(p);
  const __m256i H = NB == 2 ? _mm256_inserti128_si256(_mm256_castsi128_si256(h0), ld128(p + kBytes), 1)
                            : _mm256_zextsi128_si256(h0);
  const __m256i X = k_scales_vec256(H);  // lane j: super-block j's 8 scales, 8 mins
  const __m256i mins = _mm256_unpackhi_epi8(X, _mm256_setzero_si256());  // int16, lane j
  // [d_0, dmin_0, d_1, dmin_1]
  const __m128 dd = _mm_cvtph_ps(_mm256_castsi256_si128(_mm256_permutevar8x32_epi32(H, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4))));
  const __m256 dmin = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(dd), _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3));
  for (int t = 0; t < R; ++t) {  // mins: lanes 4j..4j+3 x dmin_j * d_act_j
    const __m256 da = NB == 2 ? _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd(
                                                             reinterpret_cast<const double*>(a.d[t] + b)))),
                                                         _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1))
                              : _mm256_broadcast_ss(a.d[t] + b);
    const __m256i s32 = NB == 2 ? ld256(a.b32[t] + 8 * b) : _mm256_zextsi128_si256(ld128(a.b32[t] + 8 * b));
    const __m256i ms = _mm256_madd_epi16(mins, s32);
    acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_mul_ps(dmin, da), acc[t]);
  }
  const __m256i m15 = _mm256_set1_epi8(15);
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j) {
    const uint8_t* qs = p + j * kBytes + (Q5 ? 48 : 16);
    __m256i qh;
    if (Q5) qh = ld256(p + j * kBytes + 16);
    const __m256i Sb = j == 0 ? _mm256_permute2x128_si256(X, X, 0x00) : _mm256_permute2x128_si256(X, X, 0x11);
    __m256i ai[R];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m256i x = ld256(qs + 32 * (c >> 1));
      __m256i w = _mm256_and_si256(c & 1 ? _mm256_srli_epi16(x, 4) : x, m15);
      if (Q5) {  // bit c of qh[l] -> bit 4 (16-bit shifts: the bit read stays inside its byte)
        const __m256i hb = c <= 4 ? _mm256_slli_epi16(qh, 4 - c) : _mm256_srli_epi16(qh, c - 4);
        w = _mm256_or_si256(w, _mm256_and_si256(hb, _mm256_set1_epi8(16)));
      }
      const __m256i s = _mm256_shuffle_epi8(Sb, ld256(kKScaleCtl.v[c]));
      for (int t = 0; t < R; ++t) {
        const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(w, ld256(a.q[t] + (b + j) * 256 + 32 * c)), s);
        ai[t] = c == 0 ? d : _mm256_add_epi32(ai[t], d);
      }
    }
    const __m256 dj = j == 0 ? _mm256_broadcastss_ps(dd) : _mm256_permutevar8x32_ps(_mm256_castps128_ps256(dd), _mm256_set1_epi32(2));
    for (int t = 0; t < R; ++t)  // d_j * d_act_j
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[t]), _mm256_mul_ps(dj, _mm256_broadcast_ss(a.d[t] + b + j)), acc[t]);
  }
}

template <bool Q5, int R>
void kdot45(const uint8_t* row, int B, const ActRows<R>& a, float* out, int64_t ldc, int64_t pf) {
  constexpr int kBytes = Q5 ? 176 : 144;
  __m256 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm256_setzero_ps();
  int b = 0;
  for (; b + 2 <= B; b += 2) kgroup45<Q5, R, 2>(row + int64_t(b) * kBytes, b, a, acc, pf);
  if (b < B) kgroup45<Q5, R, 1>(row + int64_t(b) * kBytes, b, a, acc, pf);
  for (int t = 0; t < R; ++t) out[t * ldc] = hsum8(acc[t]);
}

struct alignas(32) Ctl8x4 {
  int8_t v[4][32];
};
constexpr Ctl8x4 q6_scale_ctl() {  // int16 words 2c (low 128-bit lane), 2c + 1 (high lane) of 8
  Ctl8x4 r{};
  for (int c = 0; c < 4; ++c)
    for (int b = 0; b < 32; ++b) r.v[c][b] = int8_t(2 * (2 * c + b / 16) + (b & 1));
  return r;
}
constexpr Ctl8x4 kQ6ScaleCtl = q6_scale_ctl();

struct DecQ6K {  // 210 B: ql 128, qh 64, int8 scales 16, d; u in [0, 63], w = d * sc * (u - 32)
  static constexpr int kBytes = 210;
  static constexpr bool kIntMins = true;
  float d;
  __m256i mins, s03, s47;  // s03 / s47: int16 scales 0-7 / 8-15 in both 128-bit lanes
  const uint8_t* p;
  void load(const uint8_t* blk) {
    p = blk;
    d = h2f(p + 208);
    const __m256i s16 = _mm256_cvtepi8_epi16(ld128(p + 192));
    mins = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(s16, 5));
    s03 = _mm256_permute2x128_si256(s16, s16, 0x00);
    s47 = _mm256_permute2x128_si256(s16, s16, 0x11);
  }
  // sub-block c (32 values = groups 2c, 2c + 1): lanes 0-7 <- scale 2c, 8-15 <- scale 2c + 1
  __m256i sc(int c) const { return _mm256_shuffle_epi8(c < 4 ? s03 : s47, ld256(kQ6ScaleCtl.v[c & 3])); }
  // values 128h + 32k + l: nibble k / 2 of ql[64h + 32(k % 2) + l], bit pair k of qh[32h + l]
  __m256i w(int c) const {
    const int h = c >> 2, k = c & 3;
    const __m256i L = ld256(p + 64 * h + 32 * (k & 1)), Q = ld256(p + 128 + 32 * h);
    const __m256i lo = _mm256_and_si256(k < 2 ? L : _mm256_srli_epi16(L, 4), _mm256_set1_epi8(15));
    const __m256i hb = k == 0   ? _mm256_slli_epi16(Q, 4)
                       : k == 1 ? _mm256_slli_epi16(Q, 2)
                       : k == 2 ? Q
                                : _mm256_srli_epi16(Q, 2);
    return _mm256_or_si256(lo, _mm256_and_si256(hb, _mm256_set1_epi8(48)));
  }
};

template <int TYPE>
struct DecF {  // Q4_0 (8 x 18 B), Q8_0 (8 x 34 B), IQ4_XS (136 B) per super-block
  static constexpr int kBytes = TYPE == GG_Q4_0 ? 144 : TYPE == GG_Q8_0 ? 272 : 136;
  __m256 S;  // block scales, built in registers (scalar stores then loads stall on store forwarding)
  const uint8_t* p;
  void load(const uint8_t* blk) {
    p = blk;
    S = block_scales8<TYPE>(p);
  }
  __m256 ds(int c) const { return _mm256_permutevar8x32_ps(S, _mm256_set1_epi32(c)); }
  __m256i w(int c) const {  // block c, signed
    if (TYPE == GG_Q8_0) return ld256(p + 34 * c + 2);
    if (TYPE == GG_Q4_0) return _mm256_sub_epi8(nibbles_16(ld128(p + 18 * c + 2)), _mm256_set1_epi8(8));
    const __m256i tab = _mm256_broadcastsi128_si256(ld128(kIq4Values));
    return _mm256_shuffle_epi8(tab, nibbles_16(ld128(p + 8 + 16 * c)));
  }
};

// Q6_K (DecQ6K), one weight row x R activation rows: out[t * ldc] = dot(row, act t).
template <class D, int R>
void kdot(const uint8_t* row, int B, const ActRows<R>& a, float* out, int64_t ldc, int64_t pf) {
  static_assert(D::kIntMins, "Q4_K / Q5_K take kdot45");
  __m256 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm256_setzero_ps();
  D dec;
  for (int b = 0; b < B; ++b) {
    const uint8_t* p = row + int64_t(b) * D::kBytes;
    prefetch_sb<D::kBytes>(p, pf);
    dec.load(p);
    __m256i ai[R];
    for (int t = 0; t < R; ++t)  // the -32 offsets, in units of d: int16 group sums x -32 * scale
      ai[t] = _mm256_madd_epi16(ld256(a.bi[t] + b * 16), dec.mins);
    for (int c = 0; c < 8; ++c) {
      const __m256i w = dec.w(c), sc = dec.sc(c);
      for (int t = 0; t < R; ++t)
        ai[t] = _mm256_add_epi32(ai[t], _mm256_madd_epi16(_mm256_maddubs_epi16(w, ld256(a.q[t] + b * 256 + 32 * c)), sc));
    }
    for (int t = 0; t < R; ++t)
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[t]), _mm256_set1_ps(dec.d * a.d[t][b]), acc[t]);
  }
  for (int t = 0; t < R; ++t) out[t * ldc] = hsum8(acc[t]);
}

// Q4_0 / Q8_0 / IQ4_XS (DecF), one weight row x R activation rows (signed values, the sign trick).
template <class D, int R>
void fdot(const uint8_t* row, int B, const ActRows<R>& a, float* out, int64_t ldc, int64_t pf) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm256_setzero_ps();
  D dec;
  for (int b = 0; b < B; ++b) {
    const uint8_t* p = row + int64_t(b) * D::kBytes;
    prefetch_sb<D::kBytes>(p, pf);
    dec.load(p);
    __m256 blk[R];
    for (int t = 0; t < R; ++t) blk[t] = _mm256_setzero_ps();
    for (int c = 0; c < 8; ++c) {
      const __m256i w = dec.w(c), aw = _mm256_sign_epi8(w, w);
      const __m256 s = dec.ds(c);
      for (int t = 0; t < R; ++t) {
        const __m256i av = ld256(a.q[t] + b * 256 + 32 * c);
        const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(av, w)), ones);
        blk[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, blk[t]);
      }
    }
    for (int t = 0; t < R; ++t) acc[t] = _mm256_fmadd_ps(blk[t], _mm256_set1_ps(a.d[t][b]), acc[t]);
  }
  for (int t = 0; t < R; ++t) out[t * ldc] = hsum8(acc[t]);
}

template <int R>
void direct_row(int type, const uint8_t* row, int B, const ActRows<R>& a, float* out, int64_t ldc, int64_t pf) {
  switch (type) {
    case GG_Q4_K: return kdot45<false, R>(row, B, a, out, ldc, pf);
    case GG_Q5_K: return kdot45<true, R>(row, B, a, out, ldc, pf);
    case GG_Q6_K: return kdot<DecQ6K, R>(row, B, a, out, ldc, pf);
    case GG_Q4_0: return fdot<DecF<GG_Q4_0>, R>(row, B, a, out, ldc, pf);
    case GG_Q8_0: return fdot<DecF<GG_Q8_0>, R>(row, B, a, out, ldc, pf);
    case GG_IQ4_XS: return fdot<DecF<GG_IQ4_XS>, R>(row, B, a, out, ldc, pf);
  }
}

#include "gguf_direct.h"
