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

template <bool Q5>
struct DecQ45K {  // Q4_K (144 B) / Q5_K (176 B): d, dmin, 12 scale bytes, [Q5: qh 32], qs 128
  static constexpr int kBytes = Q5 ? 176 : 144;
  static constexpr bool kIntMins = false;
  float d, dm;
  uint8_t s8[8];
  __m256i qh, mins;
  const uint8_t* qs;
  void load(const uint8_t* p) {
    d = h2f(p);
    dm = -h2f(p + 2);
    uint64_t sc, mn;
    k_scales8(p + 4, sc, mn);
    std::memcpy(s8, &sc, 8);
    const __m128i M = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(mn)));
    mins = _mm256_set_m128i(_mm_unpackhi_epi16(M, M), _mm_unpacklo_epi16(M, M));  // min of group g = m[g / 2]
    qs = p + (Q5 ? 48 : 16);
    if (Q5) qh = ld256(p + 16);
  }
  __m256i sc(int c) const { return _mm256_set1_epi16(short(s8[c])); }
  __m256i w(int c) const {  // sub-block c: the low (c even) or high nibbles of qs[32 * (c / 2) ..]
    const __m256i x = ld256(qs + 32 * (c >> 1));
    __m256i v = _mm256_and_si256(c & 1 ? _mm256_srli_epi16(x, 4) : x, _mm256_set1_epi8(15));
    if (Q5) {  // bit c of qh[l] -> bit 4 (16-bit shifts: the bit read stays inside its byte)
      const __m256i hb = c <= 4 ? _mm256_slli_epi16(qh, 4 - c) : _mm256_srli_epi16(qh, c - 4);
      v = _mm256_or_si256(v, _mm256_and_si256(hb, _mm256_set1_epi8(16)));
    }
    return v;
  }
};

struct DecQ6K {  // 210 B: ql 128, qh 64, int8 scales 16, d; u in [0, 63], w = d * sc * (u - 32)
  static constexpr int kBytes = 210;
  static constexpr bool kIntMins = true;
  float d, dm = 0.0f;
  __m256i mins;
  const uint8_t* p;
  const int8_t* s8;
  void load(const uint8_t* blk) {
    p = blk;
    d = h2f(p + 208);
    s8 = reinterpret_cast<const int8_t*>(p + 192);
    mins = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(_mm256_cvtepi8_epi16(ld128(s8)), 5));
  }
  __m256i sc(int c) const { return _mm256_set_m128i(_mm_set1_epi16(s8[2 * c + 1]), _mm_set1_epi16(s8[2 * c])); }
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
  float s[8];  // block scales
  const uint8_t* p;
  void load(const uint8_t* blk) {
    p = blk;
    if (TYPE == GG_IQ4_XS) {
      const float d = h2f(p);
      const int sh = p[2] | (p[3] << 8);
      for (int j = 0; j < 8; ++j)
        s[j] = d * float((((p[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)) - 32);
    } else {
      for (int j = 0; j < 8; ++j) s[j] = h2f(p + j * (TYPE == GG_Q4_0 ? 18 : 34));
    }
  }
  __m256i w(int c) const {  // block c, signed
    if (TYPE == GG_Q8_0) return ld256(p + 34 * c + 2);
    if (TYPE == GG_Q4_0) return _mm256_sub_epi8(nibbles_16(ld128(p + 18 * c + 2)), _mm256_set1_epi8(8));
    const __m256i tab = _mm256_broadcastsi128_si256(ld128(kIq4Values));
    return _mm256_shuffle_epi8(tab, nibbles_16(ld128(p + 8 + 16 * c)));
  }
};

// NR weight rows (stride rs bytes) x R activation rows: out[t * ldc + i] = dot(row i, act t).
template <class D, int NR, int R>
void kdot(const uint8_t* row, int64_t rs, int B, const ActRows<R>& a, float* out, int64_t ldc, int64_t pf) {
  __m256 acc[NR][R], accm[NR][R];
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < R; ++t) acc[i][t] = accm[i][t] = _mm256_setzero_ps();
  D dec[NR];
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < NR; ++i) {
      const uint8_t* p = row + i * rs + int64_t(b) * D::kBytes;
      prefetch_sb<D::kBytes>(p, pf);
      dec[i].load(p);
    }
    __m256i ai[NR][R];
    for (int i = 0; i < NR; ++i)
      for (int t = 0; t < R; ++t) ai[i][t] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      __m256i av[R];
      for (int t = 0; t < R; ++t) av[t] = ld256(a.q[t] + b * 256 + 32 * c);
      for (int i = 0; i < NR; ++i) {
        const __m256i w = dec[i].w(c), s = dec[i].sc(c);
        for (int t = 0; t < R; ++t)
          ai[i][t] = _mm256_add_epi32(ai[i][t], _mm256_madd_epi16(_mm256_maddubs_epi16(w, av[t]), s));
      }
    }
    for (int t = 0; t < R; ++t) {
      const __m256i bv = ld256(a.bi[t] + b * 16);
      const float da = a.d[t][b];
      for (int i = 0; i < NR; ++i) {
        const __m256i m = _mm256_madd_epi16(bv, dec[i].mins);
        if (D::kIntMins)
          ai[i][t] = _mm256_add_epi32(ai[i][t], m);
        else
          accm[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(dec[i].dm * da), accm[i][t]);
        acc[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[i][t]), _mm256_set1_ps(dec[i].d * da), acc[i][t]);
      }
    }
  }
  for (int t = 0; t < R; ++t)
    for (int i = 0; i < NR; ++i) out[t * ldc + i] = hsum8(_mm256_add_ps(acc[i][t], accm[i][t]));
}

template <class D, int NR, int R>
void fdot(const uint8_t* row, int64_t rs, int B, const ActRows<R>& a, float* out, int64_t ldc, int64_t pf) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NR][R];
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < R; ++t) acc[i][t] = _mm256_setzero_ps();
  D dec[NR];
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < NR; ++i) {
      const uint8_t* p = row + i * rs + int64_t(b) * D::kBytes;
      prefetch_sb<D::kBytes>(p, pf);
      dec[i].load(p);
    }
    __m256 blk[NR][R];
    for (int i = 0; i < NR; ++i)
      for (int t = 0; t < R; ++t) blk[i][t] = _mm256_setzero_ps();
    for (int c = 0; c < 8; ++c) {
      __m256i av[R];
      for (int t = 0; t < R; ++t) av[t] = ld256(a.q[t] + b * 256 + 32 * c);
      for (int i = 0; i < NR; ++i) {
        const __m256i w = dec[i].w(c), aw = _mm256_sign_epi8(w, w);
        const __m256 s = _mm256_set1_ps(dec[i].s[c]);
        for (int t = 0; t < R; ++t) {
          const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(av[t], w)), ones);
          blk[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, blk[i][t]);
        }
      }
    }
    for (int t = 0; t < R; ++t) {
      const __m256 da = _mm256_set1_ps(a.d[t][b]);
      for (int i = 0; i < NR; ++i) acc[i][t] = _mm256_fmadd_ps(blk[i][t], da, acc[i][t]);
    }
  }
  for (int t = 0; t < R; ++t)
    for (int i = 0; i < NR; ++i) out[t * ldc + i] = hsum8(acc[i][t]);
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
// m0 .. m0 + mr - 1 (mr <= 4): out[t * ldc + r] = the dots. pf: prefetch distance (0: none).
void direct_rows(int type, const uint8_t* row, int64_t rs, int nrows, int B, const ActView& A, int K, int m0, int mr,
                 float* out, int64_t ldc, int pf) {
  switch (mr) {
    case 4: return direct_m<4>(type, row, rs, nrows, B, A, K, m0, out, ldc, pf);
    case 3: return direct_m<3>(type, row, rs, nrows, B, A, K, m0, out, ldc, pf);
    case 2: return direct_m<2>(type, row, rs, nrows, B, A, K, m0, out, ldc, pf);
    default: return direct_m<1>(type, row, rs, nrows, B, A, K, m0, out, ldc, pf);
  }
}
