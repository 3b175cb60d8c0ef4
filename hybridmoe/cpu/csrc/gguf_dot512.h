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
alignas(64) constexpr int16_t kIdxPair16[32] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
alignas(64) constexpr int16_t kIdxQuad16[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
alignas(64) constexpr int32_t kIdxPair32[16] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
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

template <bool Q5>
struct DecQ45K {  // Q4_K (144 B) / Q5_K (176 B): d, dmin, 12 scale bytes, [Q5: qh 32], qs 128
  static constexpr int kBytes = Q5 ? 176 : 144;
  static constexpr bool kIntMins = false;
  float d, dm;
  __m512i S, qh2;
  __m256i mins;
  const uint8_t* qs;
  void load(const uint8_t* p) {
    d = h2f(p);
    dm = -h2f(p + 2);
    uint64_t sc, mn;
    k_scales8(p + 4, sc, mn);
    S = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(sc))));
    const __m128i M = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(mn)));
    mins = _mm256_set_m128i(_mm_unpackhi_epi16(M, M), _mm_unpacklo_epi16(M, M));  // min of group g = m[g / 2]
    qs = p + (Q5 ? 48 : 16);
    if (Q5) qh2 = join256(ld256(p + 16), ld256(p + 16));
  }
  __m512i sc(int c) const {
    return _mm512_permutexvar_epi16(_mm512_add_epi16(ld512(kIdxPair16), _mm512_set1_epi16(short(2 * c))), S);
  }
  __m512i w(int c) const {  // 32 bytes hold sub-block 2c (low nibbles) and 2c + 1 (high)
    const __m256i x = ld256(qs + 32 * c);
    __m512i v = _mm512_and_si512(join256(x, _mm256_srli_epi16(x, 4)), _mm512_set1_epi8(15));
    if (Q5) {  // bit j of qh[l] is bit 4 of value 32j + l
      const __m512i sel = join256(_mm256_set1_epi8(char(1 << (2 * c))), _mm256_set1_epi8(char(1 << (2 * c + 1))));
      v = _mm512_mask_add_epi8(v, _mm512_test_epi8_mask(qh2, sel), v, _mm512_set1_epi8(16));
    }
    return v;
  }
};

struct DecQ6K {  // 210 B: ql 128, qh 64, int8 scales 16, d; u in [0, 63], w = d * sc * (u - 32)
  static constexpr int kBytes = 210;
  static constexpr bool kIntMins = true;
  float d, dm = 0.0f;
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
  __m512i sc(int c) const {
    return _mm512_permutexvar_epi16(_mm512_add_epi16(ld512(kIdxQuad16), _mm512_set1_epi16(short(4 * c))), S);
  }
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

inline short ld16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return short(v);
}
// 8 fp16 scales, one per 32-value block of `stride` bytes (built in registers: scalar stores then a
// vector load of them would stall on store forwarding)
inline __m256 scales8_f16(const uint8_t* p, int s) {
  return _mm256_cvtph_ps(_mm_setr_epi16(ld16(p), ld16(p + s), ld16(p + 2 * s), ld16(p + 3 * s), ld16(p + 4 * s),
                                        ld16(p + 5 * s), ld16(p + 6 * s), ld16(p + 7 * s)));
}

template <int TYPE>
struct DecF {  // Q4_0 (8 x 18 B), Q8_0 (8 x 34 B), IQ4_XS (136 B) per super-block
  static constexpr int kBytes = TYPE == GG_Q4_0 ? 144 : TYPE == GG_Q8_0 ? 272 : 136;
  static constexpr float kOff = TYPE == GG_Q4_0 ? 8.0f : 128.0f;
  __m512 D, corr;  // D: block scales in lanes 0..7; corr: -kOff * scale of group g
  const uint8_t* p;
  void load(const uint8_t* blk) {
    p = blk;
    __m256 s;
    if (TYPE == GG_IQ4_XS) {
      // ls_j = low nibble j of the 4 bytes at p + 4 | bits 2j, 2j + 1 of the u16 at p + 2, << 4
      uint32_t lo;
      std::memcpy(&lo, p + 4, 4);
      const __m256i j4 = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
      const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(lo)), j4), _mm256_set1_epi32(15));
      const __m256i hi = _mm256_srlv_epi32(_mm256_set1_epi32(p[2] | (p[3] << 8)), _mm256_srli_epi32(j4, 1));
      const __m256i ls = _mm256_or_si256(nib, _mm256_slli_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(3)), 4));
      s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))), _mm256_set1_ps(h2f(p)));
    } else {
      s = scales8_f16(p, TYPE == GG_Q4_0 ? 18 : 34);
    }
    D = _mm512_castps256_ps512(s);
    corr = _mm512_mul_ps(_mm512_permutexvar_ps(ld512(kIdxHalf32), D), _mm512_set1_ps(-kOff));
  }
  __m512 ds(int c) const {
    return _mm512_permutexvar_ps(_mm512_add_epi32(ld512(kIdxPair32), _mm512_set1_epi32(2 * c)), D);
  }
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

// NR weight rows (stride rs bytes) x R activation rows: out[t * ldc + i] = dot(row i, act t).
template <class D, int NR, int R>
void kdot(const uint8_t* row, int64_t rs, int B, const ActRows<R>& a, float* out, int64_t ldc, int64_t pf) {
  __m512 acc[NR][R];
  __m256 accm[NR][R];
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < R; ++t) {
      acc[i][t] = _mm512_setzero_ps();
      accm[i][t] = _mm256_setzero_ps();
    }
  D dec[NR];
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < NR; ++i) {
      const uint8_t* p = row + i * rs + int64_t(b) * D::kBytes;
      prefetch_sb<D::kBytes>(p, pf);
      dec[i].load(p);
    }
    __m512i ai[NR][R];
    for (int i = 0; i < NR; ++i)
      for (int t = 0; t < R; ++t) ai[i][t] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      __m512i av[R];
      for (int t = 0; t < R; ++t) av[t] = ld512(a.q[t] + b * 256 + 64 * c);
      for (int i = 0; i < NR; ++i) {
        const __m512i w = dec[i].w(c), s = dec[i].sc(c);
        for (int t = 0; t < R; ++t) ai[i][t] = _mm512_dpwssd_epi32(ai[i][t], _mm512_maddubs_epi16(w, av[t]), s);
      }
    }
    for (int t = 0; t < R; ++t) {
      const __m256i bv = ld256(a.bi[t] + b * 16);
      const float da = a.d[t][b];
      for (int i = 0; i < NR; ++i) {
        const __m256i m = _mm256_madd_epi16(bv, dec[i].mins);
        if (D::kIntMins)
          ai[i][t] = _mm512_add_epi32(ai[i][t], _mm512_zextsi256_si512(m));
        else
          accm[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(dec[i].dm * da), accm[i][t]);
        acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[i][t]), _mm512_set1_ps(dec[i].d * da), acc[i][t]);
      }
    }
  }
  for (int t = 0; t < R; ++t)
    for (int i = 0; i < NR; ++i) out[t * ldc + i] = _mm512_reduce_add_ps(acc[i][t]) + hsum256(accm[i][t]);
}

template <class D, int NR, int R>
void fdot(const uint8_t* row, int64_t rs, int B, const ActRows<R>& a, float* out, int64_t ldc, int64_t pf) {
  __m512 acc[NR][R];
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < R; ++t) acc[i][t] = _mm512_setzero_ps();
  D dec[NR];
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < NR; ++i) {
      const uint8_t* p = row + i * rs + int64_t(b) * D::kBytes;
      prefetch_sb<D::kBytes>(p, pf);
      dec[i].load(p);
    }
    __m512 blk[NR][R];
    for (int t = 0; t < R; ++t) {
      const __m512 bs = _mm512_loadu_ps(a.bs[t] + b * 16);
      for (int i = 0; i < NR; ++i) blk[i][t] = _mm512_mul_ps(dec[i].corr, bs);
    }
    for (int c = 0; c < 4; ++c) {
      __m512i av[R];
      for (int t = 0; t < R; ++t) av[t] = ld512(a.q[t] + b * 256 + 64 * c);
      for (int i = 0; i < NR; ++i) {
        const __m512i w = dec[i].w(c);
        const __m512 s = dec[i].ds(c);
        for (int t = 0; t < R; ++t) {
          const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, av[t]);
          blk[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, blk[i][t]);
        }
      }
    }
    for (int t = 0; t < R; ++t) {
      const __m512 da = _mm512_set1_ps(a.d[t][b]);
      for (int i = 0; i < NR; ++i) acc[i][t] = _mm512_fmadd_ps(blk[i][t], da, acc[i][t]);
    }
  }
  for (int t = 0; t < R; ++t)
    for (int i = 0; i < NR; ++i) out[t * ldc + i] = _mm512_reduce_add_ps(acc[i][t]);
}

template <int NR, int R>
void direct_nr(int type, const uint8_t* row, int64_t rs, int B, const ActRows<R>& a, float* out, int64_t ldc,
               int64_t pf) {
  switch (type) {
    case GG_Q4_K: return kdot<DecQ45K<false>, NR, R>(row, rs, B, a, out, ldc, pf);
    case GG_Q5_K: return kdot<DecQ45K<true>, NR, R>(row, rs, B, a, out, ldc, pf);
    case GG_Q6_K: return kdot<DecQ6K, NR, R>(row, rs, B, a, out, ldc, pf);
    case GG_Q4_0: return fdot<DecF<GG_Q4_0>, NR, R>(row, rs, B, a, out, ldc, pf);
    case GG_Q8_0: return fdot<DecF<GG_Q8_0>, NR, R>(row, rs, B, a, out, ldc, pf);
    case GG_IQ4_XS: return fdot<DecF<GG_IQ4_XS>, NR, R>(row, rs, B, a, out, ldc, pf);
  }
}

// nrows weight rows against R activation rows, one row after the other: the rows of a GGUF matrix
// are contiguous, so that reads one linear stream. Several rows side by side (NR > 1: 4 streams
// 1-5 KB apart) read 2.5-4x slower from DRAM on the 2-core Zen 4 (one thread, Q4_K / Q8_0,
// K = 2048) though equal from L2: the hardware prefetchers follow one stream, not four.
template <int R>
void direct_m(int type, const uint8_t* row, int64_t rs, int nrows, int B, const ActView& A, int K, int m0, float* out,
              int64_t ldc, int pf) {
  constexpr int NR = 1;
  const ActRows<R> a(A, K, m0);
  // NR rows are read side by side: prefetch the same place in a later group of NR rows, at least
  // pf bytes of the stream ahead
  const int64_t grp = NR * rs, lead = pf ? (pf + grp - 1) / grp * grp : 0;
  int r = 0;
  for (; r + NR <= nrows; r += NR) direct_nr<NR, R>(type, row + r * rs, rs, B, a, out + r, ldc, lead);
  for (; r < nrows; ++r) direct_nr<1, R>(type, row + r * rs, rs, B, a, out + r, ldc, lead);
}

// nrows weight rows (B super-blocks of `type`, stride rs bytes) against activation rows
// m0 .. m0 + mr - 1 (mr <= 8): out[t * ldc + r] = the dots. pf: prefetch distance (0: none).
void direct_rows(int type, const uint8_t* row, int64_t rs, int nrows, int B, const ActView& A, int K, int m0, int mr,
                 float* out, int64_t ldc, int pf) {
  switch (mr) {
    case 8: return direct_m<8>(type, row, rs, nrows, B, A, K, m0, out, ldc, pf);
    case 7: return direct_m<7>(type, row, rs, nrows, B, A, K, m0, out, ldc, pf);
    case 6: return direct_m<6>(type, row, rs, nrows, B, A, K, m0, out, ldc, pf);
    case 5: return direct_m<5>(type, row, rs, nrows, B, A, K, m0, out, ldc, pf);
    case 4: return direct_m<4>(type, row, rs, nrows, B, A, K, m0, out, ldc, pf);
    case 3: return direct_m<3>(type, row, rs, nrows, B, A, K, m0, out, ldc, pf);
    case 2: return direct_m<2>(type, row, rs, nrows, B, A, K, m0, out, ldc, pf);
    default: return direct_m<1>(type, row, rs, nrows, B, A, K, m0, out, ldc, pf);
  }
}
