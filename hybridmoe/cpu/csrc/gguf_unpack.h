// GGUF super-block (256 values) -> UBlk, per type. Included inside an anonymous namespace by each
// GGUF kernel unit (compiled with that unit's ISA flags; plain loops the compiler vectorizes).
// VNNI = true (AVX-512 dpbusd, u8 x s8): signed types store u = w + 128 and fold -128 S_g into the
// bias; VNNI = false (AVX2 maddubs): signed types store w itself (the dot uses the sign trick),
// unsigned types stay below 64 so maddubs' int16 pair sums cannot saturate (2 * 63 * 127).
// Requires <immintrin.h> and gguf_common.h.

constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

inline float h2f(const uint8_t* p) { return _cvtsh_ss(uint16_t(p[0] | (p[1] << 8))); }

// sl[v/4] = S[v/16]
inline void spread_scales(const float* S, UBlk& o) {
  for (int j = 0; j < 64; ++j) o.sl[j] = S[j >> 2];
}

template <bool VNNI>
inline void finish_signed(float* S, UBlk& o) {
  if (!VNNI) return;
  for (int v = 0; v < 256; ++v) o.u[v] ^= 0x80;
  for (int g = 0; g < 16; ++g) o.bias[g] -= 128.0f * S[g];
}

// Q4_K / Q5_K 6-bit scales and mins of sub-block j (32 values)
inline void k_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Row `row` (bytes of the whole row), super-block b -> o.
template <bool VNNI>
inline void unpack_block(int type, const uint8_t* row, int b, UBlk& o) {
  float S[16];
  switch (type) {
    case GG_Q4_0:
    case GG_Q8_0: {
      const int bs = type == GG_Q4_0 ? 18 : 34;
      for (int i = 0; i < 8; ++i) {
        const uint8_t* p = row + int64_t(b * 8 + i) * bs;
        const float d = h2f(p);
        S[2 * i] = S[2 * i + 1] = d;
        if (type == GG_Q4_0) {
          for (int j = 0; j < 16; ++j) {
            o.u[32 * i + j] = p[2 + j] & 15;
            o.u[32 * i + 16 + j] = p[2 + j] >> 4;
          }
          o.bias[2 * i] = o.bias[2 * i + 1] = -8.0f * d;
        } else {
          for (int j = 0; j < 32; ++j) o.u[32 * i + j] = p[2 + j];
          o.bias[2 * i] = o.bias[2 * i + 1] = 0.0f;
        }
      }
      if (type == GG_Q8_0) finish_signed<VNNI>(S, o);
      break;
    }
    case GG_Q4_K:
    case GG_Q5_K: {
      const uint8_t* p = row + int64_t(b) * (type == GG_Q4_K ? 144 : 176);
      const float d = h2f(p), dmin = h2f(p + 2);
      const uint8_t* qs = p + (type == GG_Q4_K ? 16 : 48);
      for (int j = 0; j < 8; ++j) {
        int sc, m;
        k_scale_min(p + 4, j, sc, m);
        S[2 * j] = S[2 * j + 1] = d * float(sc);
        o.bias[2 * j] = o.bias[2 * j + 1] = -dmin * float(m);
      }
      for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
          o.u[64 * c + l] = qs[32 * c + l] & 15;
          o.u[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        }
      if (type == GG_Q5_K) {
        const uint8_t* qh = p + 16;
        for (int j = 0; j < 8; ++j)
          for (int l = 0; l < 32; ++l) o.u[32 * j + l] |= ((qh[l] >> j) & 1) << 4;
      }
      break;
    }
    case GG_Q6_K: {
      const uint8_t* p = row + int64_t(b) * 210;
      const uint8_t *ql = p, *qh = p + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
      const float d = h2f(p + 208);
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < 128; ++r)
          o.u[128 * h + r] = uint8_t(((ql[64 * h + (r & 63)] >> (4 * (r >> 6))) & 15) |
                                     (((qh[32 * h + (r & 31)] >> (2 * (r >> 5))) & 3) << 4));
      for (int g = 0; g < 16; ++g) {
        S[g] = d * float(sc[g]);
        o.bias[g] = -32.0f * S[g];
      }
      break;
    }
    case GG_IQ4_XS: {
      const uint8_t* p = row + int64_t(b) * 136;
      const float d = h2f(p);
      const int sh = p[2] | (p[3] << 8);
      for (int j = 0; j < 8; ++j) {
        const int ls = ((p[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4);
        S[2 * j] = S[2 * j + 1] = d * float(ls - 32);
        o.bias[2 * j] = o.bias[2 * j + 1] = 0.0f;
        const uint8_t* qs = p + 8 + 16 * j;
        for (int l = 0; l < 16; ++l) {
          o.u[32 * j + l] = uint8_t(kIq4Values[qs[l] & 15]);
          o.u[32 * j + 16 + l] = uint8_t(kIq4Values[qs[l] >> 4]);
        }
      }
      finish_signed<VNNI>(S, o);
      break;
    }
  }
  spread_scales(S, o);
}

// Block b (values 256 b .. 256 b + 255, in x) of an activation row of K values -> its parts of the
// Q8_K-style row dst (gguf_common.h): q, bs, d, bi, qp, b32 of one block are bytes no other block
// writes, so different threads may convert the blocks of one row concurrently (moe.cpp converts
// each block of the expert activation as soon as the gate/up items that produce it are done).
// Returns false on NaN or Inf. Scalar loops: the compiler vectorizes them with the unit's ISA.
inline bool quant_act_blk(const float* x, int K, int b, uint8_t* dst) {
  int8_t* q = reinterpret_cast<int8_t*>(dst) + b * 256;
  float* bs = reinterpret_cast<float*>(dst + K) + b * 16;
  float* dd = reinterpret_cast<float*>(dst + K) + K / 16;
  int16_t* bi = reinterpret_cast<int16_t*>(dd + K / 256) + b * 16;
  int8_t* qp = reinterpret_cast<int8_t*>(dst + gguf_act_qp_offset(K)) + b * 256;
  int16_t* b32 = reinterpret_cast<int16_t*>(dst + gguf_act_qp_offset(K) + K) + b * 8;
  // max |x| on the bits: without the sign bit, finite floats order as their uint32 bits, and Inf and
  // NaN (exponent all ones) lie above every finite one. An integer max reduction vectorizes; the float
  // one (a > amax ? a : amax) and an early-exit NaN test stayed scalar (70% of the row's time).
  uint32_t mb = 0;
  for (int i = 0; i < 256; ++i) {
    uint32_t u;
    std::memcpy(&u, &x[i], 4);
    u &= 0x7FFFFFFFu;
    mb = u > mb ? u : mb;
  }
  if (mb >= 0x7F800000u) return false;  // Inf or NaN
  float amax;
  std::memcpy(&amax, &mb, 4);
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (int i = 0; i < 256; ++i) q[i] = int8_t(std::nearbyint(x[i] * inv));
  for (int g = 0; g < 16; ++g) {
    int s = 0;
    for (int i = 0; i < 16; ++i) s += q[g * 16 + i];
    bs[g] = float(s);
    bi[g] = int16_t(s);
  }
  for (int j = 0; j < 8; ++j) {
    b32[j] = int16_t(bi[2 * j] + bi[2 * j + 1]);
    const int to = (j & 4) | ((j & 1) << 1) | ((j >> 1) & 1);  // 0 2 1 3 4 6 5 7: sub-block j goes to slot to
    std::memcpy(qp + 32 * to, q + 32 * j, 32);
  }
  dd[b] = amax / 127.0f;
  return true;
}

// Activation row -> the Q8_K-style row (gguf_common.h). src holds K values of dtype dt; Kp == K.
// Returns false on NaN or Inf.
inline bool quant_act_row(const void* src, int dt, int K, uint8_t* dst) {
  alignas(64) float x[256];
  for (int b = 0; b < K / 256; ++b) {
    const float* xb = x;
    if (dt == DT_F32) {
      xb = static_cast<const float*>(src) + b * 256;
    } else {
      const uint16_t* s = static_cast<const uint16_t*>(src) + b * 256;
      for (int i = 0; i < 256; ++i) {
        uint32_t u = uint32_t(s[i]) << 16;
        std::memcpy(&x[i], &u, 4);
      }
    }
    if (!quant_act_blk(xb, K, b, dst)) return false;
  }
  return true;
}

// R consecutive activation rows of a view, split into their parts (gguf_common.h layout).
template <int R>
struct ActRows {
  const int8_t* q[R];
  const float* bs[R];
  const float* d[R];
  const int16_t* bi[R];
  const int8_t* qp[R];
  const int16_t* b32[R];
  ActRows(const ActView& A, int K, int m0) {
    for (int t = 0; t < R; ++t) {
      const uint8_t* row = A.data + (m0 + t) * A.ld;
      q[t] = reinterpret_cast<const int8_t*>(row);
      bs[t] = reinterpret_cast<const float*>(row + K);
      d[t] = bs[t] + K / 16;
      bi[t] = reinterpret_cast<const int16_t*>(d[t] + K / 256);
      qp[t] = reinterpret_cast<const int8_t*>(row + gguf_act_qp_offset(K));
      b32[t] = reinterpret_cast<const int16_t*>(qp[t] + K);
    }
  }
};

// Q4_K / Q5_K: the 8 6-bit scales (sc) and mins (mn) of a super-block as bytes, from its 12 scale
// bytes s, with 32-bit word operations (k_scale_min per j, all at once).
inline void k_scales8(const uint8_t* s, uint64_t& sc, uint64_t& mn) {
  uint32_t w0, w1, w2;
  std::memcpy(&w0, s, 4);
  std::memcpy(&w1, s + 4, 4);
  std::memcpy(&w2, s + 8, 4);
  const uint32_t sc_hi = (w2 & 0x0f0f0f0fu) | (((w0 >> 6) & 0x03030303u) << 4);
  const uint32_t mn_hi = ((w2 >> 4) & 0x0f0f0f0fu) | (((w1 >> 6) & 0x03030303u) << 4);
  sc = uint64_t(w0 & 0x3f3f3f3fu) | (uint64_t(sc_hi) << 32);
  mn = uint64_t(w1 & 0x3f3f3f3fu) | (uint64_t(mn_hi) << 32);
}

// Software prefetch of the lines of one super-block of BYTES, pf bytes ahead (0: none). Addresses
// at most 64 apart cover every line of consecutive super-blocks.
template <int BYTES>
inline void prefetch_sb(const uint8_t* p, int64_t pf) {
  if (!pf) return;
  for (int o = 0; o < BYTES; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + pf + o), _MM_HINT_T0);
}

// Q4_K / Q5_K scale bytes, all 8 sub-blocks at once: bytes 0-7 = the 6-bit scales, 8-15 = the
// 6-bit mins (k_scale_min of j = 0..7), from the 16-byte head h (d, dmin, the 12 scale bytes).
inline __m128i k_scales_vec(__m128i h) {
  const __m128i A = _mm_shuffle_epi8(h, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m128i B = _mm_shuffle_epi8(h, _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
  const __m128i lo = _mm_and_si128(A, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
  const __m128i a4 = _mm_and_si128(_mm_srli_epi16(A, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15));
  const __m128i b2 = _mm_and_si128(_mm_srli_epi16(B, 2), _mm_setr_epi8(0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48));
  return _mm_or_si128(_mm_or_si128(lo, a4), b2);
}

inline float hsum128(__m128 s) {
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline short ld16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return short(v);
}
// 8 fp16 scales, one per 32-value block of `stride` bytes, built in registers (scalar stores then a
// vector load of them would stall on store forwarding): one move and 7 word inserts from memory
// (10 instructions with the conversion; _mm_setr_epi16 compiles to 16).
inline __m256 scales8_f16(const uint8_t* p, int s) {
  __m128i v = _mm_cvtsi32_si128(uint16_t(ld16(p)));
  v = _mm_insert_epi16(v, ld16(p + s), 1);
  v = _mm_insert_epi16(v, ld16(p + 2 * s), 2);
  v = _mm_insert_epi16(v, ld16(p + 3 * s), 3);
  v = _mm_insert_epi16(v, ld16(p + 4 * s), 4);
  v = _mm_insert_epi16(v, ld16(p + 5 * s), 5);
  v = _mm_insert_epi16(v, ld16(p + 6 * s), 6);
  v = _mm_insert_epi16(v, ld16(p + 7 * s), 7);
  return _mm256_cvtph_ps(v);
}

// The 8 float scales of a per-32 super-block (Q4_0, Q8_0: fp16 d of each block; IQ4_XS: d times
// the 6-bit ls_j - 32, ls_j = low nibble j of the 4 bytes at p + 4 | bits 2j, 2j + 1 of the u16 at
// p + 2, << 4), in registers.
template <int TYPE>
inline __m256 block_scales8(const uint8_t* p) {
  if (TYPE != GG_IQ4_XS) return scales8_f16(p, TYPE == GG_Q4_0 ? 18 : 34);
  uint32_t lo;
  std::memcpy(&lo, p + 4, 4);
  const __m256i j4 = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(lo)), j4), _mm256_set1_epi32(15));
  const __m256i hi = _mm256_srlv_epi32(_mm256_set1_epi32(p[2] | (p[3] << 8)), _mm256_srli_epi32(j4, 1));
  const __m256i ls = _mm256_or_si256(nib, _mm256_slli_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(3)), 4));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))), _mm256_set1_ps(h2f(p)));
}

// IQ4_XS code values + 128 (u8: the AVX-512 dpbusd form of the signed table)
constexpr uint8_t kIq4ValuesU[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
