// GGUF block kernels, AVX-512 (F/BW/VL + VNNI): per 64 values one dpbusd (u8 weights from the
// unpacked tile x s8 activations) gives 16 int32 sums of 4 products, converted and scaled per lane
// (sl), plus the group bias times the activation group sums; MR activation rows share each weight
// register. Every symbol has internal linkage (see moe_avx512.cpp on template instances).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

#include "gguf_common.h"
#ifdef HM_GGUF_AMX  // gguf_amx.cpp / gguf_amx_emu.cpp: this unit with the AMX tile path
#include "amx_tiles.h"
#endif

namespace hm {
namespace {

constexpr bool kVnni = true;
constexpr int MR = 8;  // activation rows per register block

#include "gguf_unpack.h"
#include "gguf_dot512.h"

// R activation rows' values q, per-16 sums bs and per-super-block scales dd (gguf_common.h row layout).
template <int R>
struct ActPtrs {
  const int8_t* q[R];
  const float *bs[R], *dd[R];
  ActPtrs(const ActView& A, int K, int m0) {
    for (int t = 0; t < R; ++t) {
      const uint8_t* row = A.data + (m0 + t) * A.ld;
      q[t] = reinterpret_cast<const int8_t*>(row);
      bs[t] = reinterpret_cast<const float*>(row + K);
      dd[t] = bs[t] + K / 16;
    }
  }
};

// The row-major tile dot, no longer called here (tile_rows below takes the tile path) but compiled for
// gguf_gemm.h's generic branch: taking it and that branch out measured 5-8% slower at T=4096 (2-core Zen 4,
// three interleaved rounds; code layout, not looked into), so it stays for now.
template <int R>
void dot(const UBlk* U, int B, const ActView& A, int K, int m0, float* out, int64_t ldc) {
  const ActPtrs<R> ap(A, K, m0);
  const auto &q = ap.q, &bs = ap.bs, &dd = ap.dd;
  __m512 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm512_setzero_ps();
  for (int b = 0; b < B; ++b) {
    const UBlk& u = U[b];
    const __m512 bias = _mm512_load_ps(u.bias);
    __m512 blk[R];
    for (int t = 0; t < R; ++t) blk[t] = _mm512_mul_ps(bias, _mm512_loadu_ps(bs[t] + b * 16));
    for (int c = 0; c < 4; ++c) {
      const __m512i w = _mm512_load_si512(u.u + 64 * c);
      const __m512 sl = _mm512_load_ps(u.sl + 16 * c);
      for (int t = 0; t < R; ++t) {
        const __m512i a = _mm512_loadu_si512(q[t] + b * 256 + 64 * c);
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a);
        blk[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sl, blk[t]);
      }
    }
    for (int t = 0; t < R; ++t) acc[t] = _mm512_fmadd_ps(blk[t], _mm512_set1_ps(dd[t][b]), acc[t]);
  }
  for (int t = 0; t < R; ++t) out[t * ldc] = _mm512_reduce_add_ps(acc[t]);
}

void dot_rows(const UBlk* U, int B, const ActView& A, int K, int m0, int mr, bool, float* out, int64_t ldc) {
  switch (mr) {
    case 8: return dot<8>(U, B, A, K, m0, out, ldc);
    case 7: return dot<7>(U, B, A, K, m0, out, ldc);
    case 6: return dot<6>(U, B, A, K, m0, out, ldc);
    case 5: return dot<5>(U, B, A, K, m0, out, ldc);
    case 4: return dot<4>(U, B, A, K, m0, out, ldc);
    case 3: return dot<3>(U, B, A, K, m0, out, ldc);
    case 2: return dot<2>(U, B, A, K, m0, out, ldc);
    default: return dot<1>(U, B, A, K, m0, out, ldc);
  }
}

// Large T (more than kGgufDirectRows rows an expert), the step-layout tile: each unpacked super-block of
// an N-block's 16 rows is transposed so that one register holds values 4s..4s+3 of all 16 rows (as the
// AMXINT8 packing); one dpbusd then gives 64 products of 16 output rows for one activation row (its 4
// values broadcast), and the float work is one conversion and two fmas per 16 (Q6_K) or 32 values and
// activation row, where the row-major `dot` above spends a conversion, an fma and a load per 64 values
// and reduces each output across lanes at the end.
struct alignas(64) VBlk {
  uint8_t w[64][64];   // step s: [16 rows][4 values]
  float s[16][16];     // scale of group g (values 16 g ..) per row
  float bias[16][16];  // bias of group g per row (times the activation group sum)
};

struct VBuf {
  VBlk* p = nullptr;
  int64_t cap = 0;
  ~VBuf() { std::free(p); }
  VBlk* get(int64_t n) {
    if (n > cap) {
      std::free(p);
      p = static_cast<VBlk*>(std::aligned_alloc(64, size_t(n) * sizeof(VBlk)));
      if (!p) throw std::bad_alloc();
      cap = n;
    }
    return p;
  }
};
thread_local VBuf tl_vbuf;

// r[i] = 16 dwords of row i -> r[j] = dword j of rows 0..15 (4 rounds of 16 shuffles).
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + c], 128-bit lane k: dword 4k + c of rows i..i+3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    r[4 + c] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
}

// U: nrows (<= 16) rows of B unpacked super-blocks, row-major -> V[B]; rows past nrows are zero.
void to_step_layout(const UBlk* U, int B, int nrows, VBlk* V) {
  const __m512i every4th = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60);
  __m512i r[16];
  for (int b = 0; b < B; ++b) {
    VBlk& v = V[b];
    for (int c = 0; c < 4; ++c) {  // steps 16c .. 16c + 15: dwords 16c .. of each row's values
      for (int n = 0; n < 16; ++n)
        r[n] = n < nrows ? _mm512_load_si512(U[n * B + b].u + 64 * c) : _mm512_setzero_si512();
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_store_si512(v.w[16 * c + j], r[j]);
    }
    for (int n = 0; n < 16; ++n)  // group g's scale is sl[4 g]
      r[n] = n < nrows ? _mm512_castps_si512(_mm512_i32gather_ps(every4th, U[n * B + b].sl, 4)) : _mm512_setzero_si512();
    transpose16(r);
    for (int g = 0; g < 16; ++g) _mm512_store_si512(v.s[g], r[g]);
    for (int n = 0; n < 16; ++n)
      r[n] = n < nrows ? _mm512_castps_si512(_mm512_load_ps(U[n * B + b].bias)) : _mm512_setzero_si512();
    transpose16(r);
    for (int g = 0; g < 16; ++g) _mm512_store_si512(v.bias[g], r[g]);
  }
}

// C[t * ldc + n], n < 16: activation rows m0 .. m0 + R - 1 against the tile. G: values a scale covers
// (32: the two 16-groups of a pair share scale and bias, every type but Q6_K).
template <int R, int G>
void step_dot(const VBlk* V, int B, const ActView& A, int K, int m0, float* C, int64_t ldc) {
  const ActPtrs<R> ap(A, K, m0);
  const auto &q = ap.q, &bs = ap.bs, &dd = ap.dd;
  __m512 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm512_setzero_ps();
  for (int b = 0; b < B; ++b) {
    const VBlk& v = V[b];
    __m512 blk[R];
    for (int t = 0; t < R; ++t) blk[t] = _mm512_setzero_ps();
    for (int g = 0; g < 16; g += G / 16) {
      __m512i p[R];
      for (int t = 0; t < R; ++t) p[t] = _mm512_setzero_si512();
      for (int st = 4 * g; st < 4 * g + G / 4; ++st) {
        const __m512i w = _mm512_load_si512(v.w[st]);
        for (int t = 0; t < R; ++t) {
          int32_t a;
          std::memcpy(&a, q[t] + b * 256 + 4 * st, 4);
          p[t] = _mm512_dpbusd_epi32(p[t], w, _mm512_set1_epi32(a));
        }
      }
      const __m512 sg = _mm512_load_ps(v.s[g]), bg = _mm512_load_ps(v.bias[g]);
      for (int t = 0; t < R; ++t) {
        const float* gs = bs[t] + b * 16 + g;
        const float sum = G == 32 ? gs[0] + gs[1] : gs[0];
        blk[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[t]), sg, blk[t]);
        blk[t] = _mm512_fmadd_ps(bg, _mm512_set1_ps(sum), blk[t]);
      }
    }
    for (int t = 0; t < R; ++t) acc[t] = _mm512_fmadd_ps(blk[t], _mm512_set1_ps(dd[t][b]), acc[t]);
  }
  for (int t = 0; t < R; ++t) _mm512_storeu_ps(C + t * ldc, acc[t]);
}

template <int G>
void step_rows(const VBlk* V, int B, const ActView& A, int K, int m0, int mr, float* C, int64_t ldc) {
  switch (mr) {
    case 8: return step_dot<8, G>(V, B, A, K, m0, C, ldc);
    case 7: return step_dot<7, G>(V, B, A, K, m0, C, ldc);
    case 6: return step_dot<6, G>(V, B, A, K, m0, C, ldc);
    case 5: return step_dot<5, G>(V, B, A, K, m0, C, ldc);
    case 4: return step_dot<4, G>(V, B, A, K, m0, C, ldc);
    case 3: return step_dot<3, G>(V, B, A, K, m0, C, ldc);
    case 2: return step_dot<2, G>(V, B, A, K, m0, C, ldc);
    default: return step_dot<1, G>(V, B, A, K, m0, C, ldc);
  }
}

#ifndef HM_GGUF_AMX
// The tile path of gguf_gemm.h for this unit: the N-block's unpacked rows U to the step layout, then
// MR activation rows at a time.
#define HM_GGUF_TILE_ROWS 1
void tile_rows(int type, const UBlk* U, int B, int nrows, const ActView& A, int K, int M, float* Cb, int64_t ldc) {
  VBlk* V = tl_vbuf.get(B);
  to_step_layout(U, B, nrows, V);
  for (int m0 = 0; m0 < M; m0 += MR) {
    const int mr = M - m0 < MR ? M - m0 : MR;
    if (type == GG_Q6_K)
      step_rows<16>(V, B, A, K, m0, mr, Cb + int64_t(m0) * ldc, ldc);
    else
      step_rows<32>(V, B, A, K, m0, mr, Cb + int64_t(m0) * ldc, ldc);
  }
}
#else
// AMX: 32 activation rows a pass over one N-block (16 outputs). Per group of G values (32; 16 for Q6_K, whose
// scales cover 16) the two 16-row activation tiles (16 x G s8) against the block's G / 4 steps, which the step
// layout already holds as one B tile (G / 4 rows of 64 bytes), TDPBSUD (s8 x u8) into C0 / C1; the int32 sums
// then take the group's scale and bias and, per super-block, the activation scale, as step_dot does.
// Tiles are configured for G at every call (the MoE AMX kernels configure their own).
void configure_gguf_tiles(int G) {
  alignas(64) uint8_t cfg[64];
  std::memset(cfg, 0, sizeof(cfg));
  cfg[0] = 1;  // palette
  const int shape[8][2] = {{16, 64}, {16, 64}, {0, 0}, {0, 0}, {16, G}, {16, G}, {G / 4, 64}, {0, 0}};  // rows, bytes
  for (int t = 0; t < 8; ++t) {
    cfg[16 + 2 * t] = uint8_t(shape[t][1]);
    cfg[48 + t] = uint8_t(shape[t][0]);
  }
  hm_tile_loadconfig(cfg);
}

template <int G>
void amx_pass(const VBlk* V, int B, const ActView& A, int K, int m, int M, float* C, int64_t ldc) {
  alignas(64) int32_t cb[2][256];
  alignas(64) float blk[32][16];
  alignas(64) float acc[32][16];
  const int rows = M - m < 32 ? M - m : 32, nt = rows > 16 ? 2 : 1;
  const float *bs[32], *dd[32];
  for (int r = 0; r < rows; ++r) {
    bs[r] = reinterpret_cast<const float*>(A.data + int64_t(m + r) * A.ld + K);
    dd[r] = bs[r] + K / 16;
  }
  std::memset(acc, 0, sizeof(acc));
  const uint8_t* a0 = A.data + int64_t(m) * A.ld;  // rows past M: the workspace's padding rows, dropped
  const uint8_t* a1 = a0 + 16 * A.ld;
  for (int b = 0; b < B; ++b) {
    const VBlk& v = V[b];
    std::memset(blk, 0, sizeof(blk));
    for (int g = 0; g < 256 / G; ++g) {
      hm_tile_zero(0);
      hm_tile_loadd(6, v.w[g * G / 4], 64);
      hm_tile_loadd(4, a0 + b * 256 + g * G, A.ld);
      hm_tile_dpbsud(0, 4, 6);
      hm_tile_stored(0, cb[0], 64);
      if (nt == 2) {
        hm_tile_zero(1);
        hm_tile_loadd(5, a1 + b * 256 + g * G, A.ld);
        hm_tile_dpbsud(1, 5, 6);
        hm_tile_stored(1, cb[1], 64);
      }
      const int g16 = g * G / 16;
      const __m512 sg = _mm512_load_ps(v.s[g16]), bg = _mm512_load_ps(v.bias[g16]);
      for (int r = 0; r < rows; ++r) {
        const float* gs = bs[r] + b * 16 + g16;
        const float sum = G == 32 ? gs[0] + gs[1] : gs[0];
        const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb[r >> 4] + (r & 15) * 16)), sg,
                                         _mm512_load_ps(blk[r]));
        _mm512_store_ps(blk[r], _mm512_fmadd_ps(bg, _mm512_set1_ps(sum), f));
      }
    }
    for (int r = 0; r < rows; ++r)
      _mm512_store_ps(acc[r], _mm512_fmadd_ps(_mm512_load_ps(blk[r]), _mm512_set1_ps(dd[r][b]), _mm512_load_ps(acc[r])));
  }
  for (int r = 0; r < rows; ++r) _mm512_storeu_ps(C + int64_t(m + r) * ldc, _mm512_load_ps(acc[r]));
}

#define HM_GGUF_TILE_ROWS 1
void tile_rows(int type, const UBlk* U, int B, int nrows, const ActView& A, int K, int M, float* Cb, int64_t ldc) {
  VBlk* V = tl_vbuf.get(B);
  to_step_layout(U, B, nrows, V);
  const int G = type == GG_Q6_K ? 16 : 32;
  configure_gguf_tiles(G);
  for (int m = 0; m < M; m += 32) {
    if (G == 16)
      amx_pass<16>(V, B, A, K, m, M, Cb, ldc);
    else
      amx_pass<32>(V, B, A, K, m, M, Cb, ldc);
  }
}
#endif

#include "gguf_gemm.h"

#if !defined(HM_GGUF_AMX)
const Kernels kTable = {"gguf-avx512", act_row_bytes, quant_row, gemm, quant_block};
#elif defined(HM_AMX_EMULATE)
const Kernels kTable = {"gguf-amx-emulated", act_row_bytes, quant_row, gemm, quant_block};
#else
const Kernels kTable = {"gguf-amx", act_row_bytes, quant_row, gemm, quant_block};
#endif

}  // namespace
}  // namespace hm

#if !defined(HM_GGUF_AMX)
extern "C" const hm::Kernels* hm_kernels_gguf_avx512() { return &hm::kTable; }
#elif defined(HM_AMX_EMULATE)
extern "C" const hm::Kernels* hm_kernels_gguf_amx_emu() { return &hm::kTable; }
#else
extern "C" const hm::Kernels* hm_kernels_gguf_amx() { return &hm::kTable; }
#endif
