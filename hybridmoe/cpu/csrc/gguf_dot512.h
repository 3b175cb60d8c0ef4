// Direct GGUF kernels, AVX-512 (BW + VNNI), for few activation rows per expert (decode): each weight
// row's super-blocks are unpacked in registers (nibble masks, shifts, byte shuffles) and dotted with
// R activation rows at once (R <= MR share every unpacked register); one pass over the packed
// blocks, nothing stored. Included inside an anonymous namespace after gguf_unpack.h. Two families:
//  * K-quants (Q4_K, Q5_K, Q6_K): unsigned 4..6-bit values u (<= 63); maddubs(u, q) gives int16
//    pair sums (at most 2 * 63 * 127: no saturation), dpwssd multiplies them by the int16 sub-block
//    scales into one int32 sum per lane and super-block, times d * d_act. The mins (Q6_K: the -32
//    offset, in units of d) go through the activation's int16 group sums (madd with int16 mins).
//  * per-32 float scales (Q4_0, Q8_0, IQ4_XS): u8 values (Q8_0: w ^ 0x80 = w + 128; IQ4_XS: the
//    code table + 128) dpbusd(u, q), converted and scaled per lane by the block's float scale; the
//    offset (8 or 128) times the float activation group sums.
// A 64-value register c holds values 64c..64c+63 in order, so activations load contiguously.

// int16 lane index vectors for permutexvar_epi16 (x + 2c: sub-blocks 2c, 2c+1 of Q4_K/Q5_K;
// x6 + 4c: groups 4c..4c+3 of Q6_K) and f32 lane index vectors (pair + 2c; g2: group -> block).
// One table per register c (constants, so no index arithmetic in the loops).
struct alignas(64) Idx16x4 {
  int16_t v[4][32];
};
struct alignas(64) Idx32x4 {
  int32_t v[4][16];
};
struct alignas(64) Ctl8x4 {
  int8_t v[4][64];
};
constexpr Idx16x4 quad16() {  // Q6_K: int16 lane l of register c <- scale of group 4c + l / 8
  Idx16x4 r{};
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) r.v[c][l] = int16_t(4 * c + l / 8);
  return r;
}
constexpr Idx32x4 pair32() {  // per-32 float scales: f32 lane l of register c <- block 2c + l / 8
  Idx32x4 r{};
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 16; ++l) r.v[c][l] = 2 * c + l / 8;
  return r;
}
// Q4_K / Q5_K: vpshufb controls that widen scale byte j (of the 8 in every 128-bit lane) to the
// int16 lanes of register c: lanes 0-15 <- sub-block kSubLo[c], 16-31 <- kSubHi[c] (qp order)
constexpr int kSubLo[4] = {0, 1, 4, 5}, kSubHi[4] = {2, 3, 6, 7};
constexpr Ctl8x4 kscale_ctl() {
  Ctl8x4 r{};
  for (int c = 0; c < 4; ++c)
    for (int b = 0; b < 64; ++b) r.v[c][b] = int8_t(b & 1 ? -128 : b < 32 ? kSubLo[c] : kSubHi[c]);
  return r;
}
constexpr Idx16x4 kIdxQuad16 = quad16();
constexpr Idx32x4 kIdxPair32 = pair32();
constexpr Ctl8x4 kKScaleCtl = kscale_ctl();
// kgroup45: int16 words d_j, dmin_j (word 0, 1 of 128-bit lane j) -> words 0..3, 4..7
alignas(64) constexpr int16_t kIdxDDmin[32] = {0, 8, 16, 24, 1, 9, 17, 25};
// kgroup45: f32 lanes 4j..4j+3 <- lane 4 + j (dmin_j * d_act_j)
alignas(64) constexpr int32_t kIdxMinF[16] = {4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7};
alignas(64) constexpr int32_t kIdxHalf32[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};

inline __m512i ld512(const void* p) { return _mm512_loadu_si512(p); }
inline __m256i ld256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m128i ld128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
inline __m512i join256(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
// 32 bytes of packed nibbles, two 16-byte blocks (low nibble j = value j, high = value 16 + j) ->
// 64 nibble values in order: [lo(x0), hi(x0), lo(x1), hi(x1)] per 128-bit lane
inline __m512i nibbles_2x16(__m256i x) {
  const __m512i z = join256(x, _mm256_srli_epi16(x, 4));
  return _mm512_and_si512(_mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0)), _mm512_set1_epi8(15));
}

// k_scales_vec (gguf_unpack.h) on every 128-bit lane: lane j = the 16-byte head of a super-block.
// Its constants as 64-byte tables (memory operands; broadcast from 16 bytes they cost a shuffle
// each in the short-row tail groups, where the compiler does not keep them in registers).
struct alignas(64) KScaleConsts {
  int8_t v[5][64];
};
constexpr KScaleConsts kscale_consts() {
  constexpr int8_t c[5][16] = {{4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15},
                               {-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11},
                               {63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0},
                               {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15},
                               {0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48}};
  KScaleConsts r{};
  for (int k = 0; k < 5; ++k)
    for (int i = 0; i < 64; ++i) r.v[k][i] = c[k][i % 16];
  return r;
}
constexpr KScaleConsts kKSC = kscale_consts();
inline __m512i k_scales_vec512(__m512i h) {
  const __m512i A = _mm512_shuffle_epi8(h, ld512(kKSC.v[0]));
  const __m512i B = _mm512_shuffle_epi8(h, ld512(kKSC.v[1]));
  const __m512i lo = _mm512_and_si512(A, ld512(kKSC.v[2]));
  const __m512i a4 = _mm512_and_si512(_mm512_srli_epi16(A, 4), ld512(kKSC.v[3]));
  const __m512i b2 = _mm512_and_si512(_mm512_srli_epi16(B, 2), ld512(kKSC.v[4]));
  return _mm512_or_si512(_mm512_or_si512(lo, a4), b2);
}

// Q4_K (144 B: d, dmin, 12 scale bytes, qs 128) / Q5_K (176 B: the same with qh 32 before qs), one
// weight row x R activation rows, NB (1..4) super-blocks b .. b + NB - 1 at p. 64 bytes of qs hold
// sub-blocks 2j, 2j + 2 (low nibbles) and 2j + 1, 2j + 3 (high): with the activation in that order
// (ActRows::qp) each register of values is one and (+ one shift), no lane shuffle. The scale work
// is shared by the NB super-blocks, one 128-bit lane each: their 16-byte heads in one register,
// one k_scales_vec, one unpack for the mins (int16, lane j = super-block j, as the activation's
// per-32 sums of 4 consecutive super-blocks load), one conversion of the d / dmin pairs. Per
// super-block: one lane broadcast, 4 vpshufb for the sub-block scales; per super-block and token
// 4 maddubs + madd + 3 dpwssd (one int32 chain), one conversion, one fma; per group and token one
// madd, conversion and fma for the mins. Lanes of a short group (NB < 4) are zero (heads) or
// masked (activation sums and scales), so they add exact zeros.
template <bool Q5, int R, int NB>
inline void kgroup45(const uint8_t* p, int b, const ActRows<R>& a, __m512* acc, int64_t pf) {
  constexpr int kBytes = Q5 ? 176 : 144;
  prefetch_sb<NB * kBytes>(p, pf);
  __m512i X;  // lane j: super-block j's 8 scales, 8 mins
  __m256 f[R];  // [d_j * d_act_j, dmin_j * d_act_j]
  if constexpr (NB == 1) {  // one super-block: the scale work at 128 bits
    const __m128i h = ld128(p);
    const __m128i X1 = k_scales_vec(h);
    X = _mm512_castsi128_si512(X1);
    const __m128i mins = _mm_cvtepu8_epi16(_mm_srli_si128(X1, 8));
    const __m128 dd = _mm_cvtph_ps(h);  // lanes 0, 1: d, dmin
    for (int t = 0; t < R; ++t) {
      const __m128 f1 = _mm_mul_ps(dd, _mm_set1_ps(a.d[t][b]));
      f[t] = _mm256_castps128_ps256(f1);
      const __m128 m = _mm_mul_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mins, ld128(a.b32[t] + 8 * b))), _mm_permute_ps(f1, 0x55));
      acc[t] = _mm512_sub_ps(acc[t], _mm512_zextps128_ps512(m));
    }
  } else {
    __m512i H = _mm512_zextsi128_si512(ld128(p));
    H = _mm512_inserti32x4(H, ld128(p + kBytes), 1);
    if (NB > 2) H = _mm512_inserti32x4(H, ld128(p + 2 * kBytes), 2);
    if (NB > 3) H = _mm512_inserti32x4(H, ld128(p + 3 * kBytes), 3);
    X = k_scales_vec512(H);
    const __m512i mins = _mm512_unpackhi_epi8(X, _mm512_setzero_si512());  // int16, lane j
    // [d_0 .. d_3, dmin_0 .. dmin_3] (zero heads give zero lanes)
    const __m256 dd = _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutexvar_epi16(ld512(kIdxDDmin), H)));
    constexpr __mmask16 kM = __mmask16((1u << (4 * NB)) - 1);
    for (int t = 0; t < R; ++t) {  // mins: lanes 4j..4j+3 x dmin_j * d_act_j
      const __m128 da = NB == 4 ? _mm_loadu_ps(a.d[t] + b) : _mm_maskz_loadu_ps(__mmask8((1u << NB) - 1), a.d[t] + b);
      f[t] = _mm256_mul_ps(dd, _mm256_insertf128_ps(_mm256_castps128_ps256(da), da, 1));
      const __m512i ms = _mm512_madd_epi16(mins, _mm512_maskz_loadu_epi32(kM, a.b32[t] + 8 * b));
      acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ms), _mm512_permutexvar_ps(ld512(kIdxMinF), _mm512_castps256_ps512(f[t])),
                                acc[t]);
    }
  }
  const __m512i m15 = _mm512_set1_epi8(15);
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j) {
    const uint8_t* qs = p + j * kBytes + (Q5 ? 48 : 16);
    const __m512i x0 = ld512(qs), x1 = ld512(qs + 64);
    __m512i v[4] = {_mm512_and_si512(x0, m15), _mm512_and_si512(_mm512_srli_epi16(x0, 4), m15),
                    _mm512_and_si512(x1, m15), _mm512_and_si512(_mm512_srli_epi16(x1, 4), m15)};
    if (Q5) {  // bit j of qh[l]: bit 4 of value l of sub-block j
      const __m512i qh2 = _mm512_broadcast_i64x4(ld256(p + j * kBytes + 16));
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512i sel = join256(_mm256_set1_epi8(char(1 << kSubLo[c])), _mm256_set1_epi8(char(1 << kSubHi[c])));
        v[c] = _mm512_mask_add_epi8(v[c], _mm512_test_epi8_mask(qh2, sel), v[c], _mm512_set1_epi8(16));
      }
    }
    const __m512i Sb = j == 0   ? _mm512_shuffle_i32x4(X, X, 0x00)
                       : j == 1 ? _mm512_shuffle_i32x4(X, X, 0x55)
                       : j == 2 ? _mm512_shuffle_i32x4(X, X, 0xaa)
                                : _mm512_shuffle_i32x4(X, X, 0xff);
    __m512i sc[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) sc[c] = _mm512_shuffle_epi8(Sb, ld512(kKScaleCtl.v[c]));
    for (int t = 0; t < R; ++t) {
      const int8_t* qa = a.qp[t] + (b + j) * 256;
      __m512i i0 = _mm512_madd_epi16(_mm512_maddubs_epi16(v[0], ld512(qa)), sc[0]);
      i0 = _mm512_dpwssd_epi32(i0, _mm512_maddubs_epi16(v[1], ld512(qa + 64)), sc[1]);
      i0 = _mm512_dpwssd_epi32(i0, _mm512_maddubs_epi16(v[2], ld512(qa + 128)), sc[2]);
      i0 = _mm512_dpwssd_epi32(i0, _mm512_maddubs_epi16(v[3], ld512(qa + 192)), sc[3]);
      const __m512 fj = j == 0 ? _mm512_broadcastss_ps(_mm256_castps256_ps128(f[t]))
                               : _mm512_permutexvar_ps(_mm512_set1_epi32(j), _mm512_castps256_ps512(f[t]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), fj, acc[t]);
    }
  }
}

template <bool Q5, int R>
void kdot45(const uint8_t* row, int B, const ActRows<R>& a, float* out, int64_t ldc, int64_t pf) {
  constexpr int kBytes = Q5 ? 176 : 144;
  __m512 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm512_setzero_ps();
  int b = 0;
  for (; b + 4 <= B; b += 4) kgroup45<Q5, R, 4>(row + int64_t(b) * kBytes, b, a, acc, pf);
  const uint8_t* p = row + int64_t(b) * kBytes;
  switch (B - b) {
    case 3: kgroup45<Q5, R, 3>(p, b, a, acc, pf); break;
    case 2: kgroup45<Q5, R, 2>(p, b, a, acc, pf); break;
    case 1: kgroup45<Q5, R, 1>(p, b, a, acc, pf); break;
  }
  for (int t = 0; t < R; ++t) out[t * ldc] = _mm512_reduce_add_ps(acc[t]);
}

struct DecQ6K {  // 210 B: ql 128, qh 64, int8 scales 16, d; u in [0, 63], w = d * sc * (u - 32)
  static constexpr int kBytes = 210;
  static constexpr bool kIntMins = true;
  float d;
  __m512i S;
  __m256i mins;
  const uint8_t* p;
  void load(const uint8_t* blk) {
    p = blk;
    d = h2f(p + 208);
    const __m256i s16 = _mm256_cvtepi8_epi16(ld128(p + 192));
    S = _mm512_castsi256_si512(s16);
    mins = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(s16, 5));  // -32 * scale per group
  }
  __m512i sc(int c) const { return _mm512_permutexvar_epi16(ld512(kIdxQuad16.v[c]), S); }
  // values 128h + r: ql[64h + r % 64] nibble r / 64, qh[32h + r % 32] bit pair r / 32
  __m512i w(int c) const {
    const int h = c >> 1;
    const __m512i L = ld512(p + 64 * h);
    const __m256i Q = ld256(p + 128 + 32 * h);
    const __m512i Qz = join256(Q, _mm256_srli_epi16(Q, 2));  // pairs 0 | 1 at bits 0-1, pairs 2 | 3 at 4-5
    const __m512i m15 = _mm512_set1_epi8(15), m48 = _mm512_set1_epi8(48);
    if (c & 1) return _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m15), _mm512_and_si512(Qz, m48));
    return _mm512_or_si512(_mm512_and_si512(L, m15), _mm512_and_si512(_mm512_slli_epi16(Qz, 4), m48));
  }
};

// Q4_0 / Q8_0 / IQ4_XS. The fp16 block scales come through scalar word inserts (block_scales8):
// two vpermt2w over the super-block's 64-byte lines take 6 instructions instead of 10, but the
// lines' unaligned 64-byte loads made the DRAM stream 5-8 % slower (2-core Zen 4, one thread).
template <int TYPE>
struct DecF {  // Q4_0 (8 x 18 B), Q8_0 (8 x 34 B), IQ4_XS (136 B) per super-block
  static constexpr int kBytes = TYPE == GG_Q4_0 ? 144 : TYPE == GG_Q8_0 ? 272 : 136;
  static constexpr float kOff = TYPE == GG_Q4_0 ? 8.0f : 128.0f;
  __m512 D, corr;  // D: block scales in lanes 0..7; corr: -kOff * scale of group g
  const uint8_t* p;
  void load(const uint8_t* blk) {
    p = blk;
    D = _mm512_castps256_ps512(block_scales8<TYPE>(p));
    corr = _mm512_mul_ps(_mm512_permutexvar_ps(ld512(kIdxHalf32), D), _mm512_set1_ps(-kOff));
  }
  __m512 ds(int c) const { return _mm512_permutexvar_ps(ld512(kIdxPair32.v[c]), D); }
  __m512i w(int c) const {  // blocks 2c, 2c + 1
    if (TYPE == GG_Q8_0)
      return _mm512_xor_si512(join256(ld256(p + 68 * c + 2), ld256(p + 68 * c + 36)), _mm512_set1_epi8(char(0x80)));
    if (TYPE == GG_Q4_0) {
      const __m128i b0 = ld128(p + 36 * c + 2), b1 = ld128(p + 36 * c + 20);
      return nibbles_2x16(_mm256_inserti128_si256(_mm256_castsi128_si256(b0), b1, 1));
    }
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(ld128(kIq4ValuesU)), nibbles_2x16(ld256(p + 8 + 32 * c)));
  }
};

// Q6_K (DecQ6K), one weight row x R activation rows: out[t * ldc] = dot(row, act t).
template <class D, int R>
void kdot(const uint8_t* row, int B, const ActRows<R>& a, float* out, int64_t ldc, int64_t pf) {
  static_assert(D::kIntMins, "Q4_K / Q5_K take kdot45");
  __m512 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm512_setzero_ps();
  D dec;
  for (int b = 0; b < B; ++b) {
    const uint8_t* p = row + int64_t(b) * D::kBytes;
    prefetch_sb<D::kBytes>(p, pf);
    dec.load(p);
    __m512i ai[R];
    for (int t = 0; t < R; ++t)  // the -32 offsets, in units of d: int16 group sums x -32 * scale
      ai[t] = _mm512_zextsi256_si512(_mm256_madd_epi16(ld256(a.bi[t] + b * 16), dec.mins));
    for (int c = 0; c < 4; ++c) {
      const __m512i w = dec.w(c), sc = dec.sc(c);
      for (int t = 0; t < R; ++t)
        ai[t] = _mm512_dpwssd_epi32(ai[t], _mm512_maddubs_epi16(w, ld512(a.q[t] + b * 256 + 64 * c)), sc);
    }
    for (int t = 0; t < R; ++t)
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[t]), _mm512_set1_ps(dec.d * a.d[t][b]), acc[t]);
  }
  for (int t = 0; t < R; ++t) out[t * ldc] = _mm512_reduce_add_ps(acc[t]);
}

// Q4_0 / Q8_0 / IQ4_XS (DecF), one weight row x R activation rows.
template <class D, int R>
void fdot(const uint8_t* row, int B, const ActRows<R>& a, float* out, int64_t ldc, int64_t pf) {
  __m512 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm512_setzero_ps();
  D dec;
  for (int b = 0; b < B; ++b) {
    const uint8_t* p = row + int64_t(b) * D::kBytes;
    prefetch_sb<D::kBytes>(p, pf);
    dec.load(p);
    __m512 blk[R];
    for (int t = 0; t < R; ++t) blk[t] = _mm512_mul_ps(dec.corr, _mm512_loadu_ps(a.bs[t] + b * 16));
    for (int c = 0; c < 4; ++c) {
      const __m512i w = dec.w(c);
      const __m512 s = dec.ds(c);
      for (int t = 0; t < R; ++t) {
        const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, ld512(a.q[t] + b * 256 + 64 * c));
        blk[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, blk[t]);
      }
    }
    for (int t = 0; t < R; ++t) acc[t] = _mm512_fmadd_ps(blk[t], _mm512_set1_ps(a.d[t][b]), acc[t]);
  }
  for (int t = 0; t < R; ++t) out[t * ldc] = _mm512_reduce_add_ps(acc[t]);
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
