// AMX kernels (tile + int8 + bf16) for many rows per expert; int4 and small row counts use the
// AVX-512 kernels (same activation formats: u8 = q + 128 for int8, bf16 rows for BF16 and FP8).
// FP8: each block pair is widened to bf16 once per item (fp8_to_bf16: the B-tile layout, exact) and
// reused by all its rows; each K group's tile dots are scaled by the group's scale into fp32 sums.
// Tiles: C0..C3 = 32 rows x 32 outputs (int32 / fp32), A4/A5 = 2 x 16 activation rows,
// B6/B7 = two N-blocks; the packed block layout is exactly the AMX B-tile (VNNI) layout, so a B
// tile is 1 KiB of contiguous weights. Rows past M are read from the workspace padding and dropped.
#include <immintrin.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include "kernels_avx512.h"

namespace hm {
namespace {

// Local helpers instead of std:: templates: an out-of-line template instance compiled with this
// unit's ISA flags could otherwise be picked by the linker for baseline code.
inline int imin(int a, int b) { return a < b ? a : b; }
inline float fmaxf_(float a, float b) { return a > b ? a : b; }

constexpr int AMX_MIN_ROWS = 16;  // fewer rows per expert: AVX-512 (memory bound anyway)
// FP8 from this many rows: its AVX-512 kernel widens each weight for every 8 rows and is compute-bound
// from 2-4 rows on; a widened tile pair serves up to 32 rows at tile speed
constexpr int AMX_MIN_ROWS_FP8 = 4;

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Loaded at every AMX GEMM call, not once per thread: TILERELEASE (oneDNN's AMX kernels, torch's bf16
// matmuls, run it when done) puts a thread's tiles back to the unconfigured state, and a tile load after
// it is #UD (SIGILL). A thread-local "configured" flag went stale that way on a thread that also runs
// torch (the calling thread of an inline task); one LDTILECFG per GEMM item costs nothing beside it.
void configure_tiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  _tile_loadconfig(&cfg);
}

// pf > 0: software prefetch of both weight blocks ahead of their tile loads (each k step reads 1 KiB =
// 16 lines of each block from DRAM; the blocks of a pair are adjacent, so the prefetch runs on into the
// next pair), into L1, pf bytes ahead. Only for the first 32-row pass over a pair: later passes find it
// in L2. On the H200 host at T 1024 (DeepSeek-V3 layer, session 12): 2048 ahead 4.69 TFLOP/s (0.71 of
// the adjacent stream probe) against 3.72 without, 8192 ahead 4.61; adding an L2 prefetch 4 x pf ahead
// measured 0.61 of its run's probe, and was dropped.
template <bool INT8>
void amx_pair(const uint8_t* b0, const uint8_t* b1, int Kd, const ActView& A, int m, int M, const float* sw0,
              const float* sw1, const int32_t* ws0, const int32_t* ws1, float* C, int64_t ldc, int pf) {
  alignas(64) int32_t cb[4][256];
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const uint8_t* a0 = A.data + int64_t(m) * A.ld;
  const uint8_t* a1 = a0 + 16 * A.ld;
  const int kt_n = INT8 ? Kd / 64 : Kd / 32;
  for (int kt = 0; kt < kt_n; ++kt) {
    if (pf) {
      const char* p0 = reinterpret_cast<const char*>(b0 + kt * 1024 + pf);
      const char* p1 = reinterpret_cast<const char*>(b1 + kt * 1024 + pf);
      for (int l = 0; l < 1024; l += 64) {
        _mm_prefetch(p0 + l, _MM_HINT_T0);
        _mm_prefetch(p1 + l, _MM_HINT_T0);
      }
    }
    _tile_loadd(4, a0 + kt * 64, A.ld);
    _tile_loadd(5, a1 + kt * 64, A.ld);
    _tile_loadd(6, b0 + kt * 1024, 64);
    _tile_loadd(7, b1 + kt * 1024, 64);
    if (INT8) {
      _tile_dpbusd(0, 4, 6);
      _tile_dpbusd(1, 4, 7);
      _tile_dpbusd(2, 5, 6);
      _tile_dpbusd(3, 5, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, cb[0], 64);
  _tile_stored(1, cb[1], 64);
  _tile_stored(2, cb[2], 64);
  _tile_stored(3, cb[3], 64);
  const int rows = imin(32, M - m);
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < 2; ++j) {
      const int32_t* src = cb[(r / 16) * 2 + j] + (r % 16) * 16;
      float* dst = C + int64_t(m + r) * ldc + j * 16;
      if (INT8) {
        __m512i comp = _mm512_slli_epi32(_mm512_loadu_si512(j ? ws1 : ws0), 7);
        __m512i v = _mm512_sub_epi32(_mm512_loadu_si512(src), comp);
        __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(A.scale[m + r]));
        _mm512_storeu_ps(dst, _mm512_mul_ps(f, _mm512_loadu_ps(j ? sw1 : sw0)));
      } else {
        _mm512_storeu_ps(dst, _mm512_castsi512_ps(_mm512_loadu_si512(src)));
      }
    }
}

// One 32-row x 32-output tile of FP8: b0/b1 two widened bf16 blocks, s0/s1 their scales [Kd/G].
void amx_fp8_pair(const uint16_t* b0, const uint16_t* b1, int Kd, int G, const ActView& A, int m, int M,
                  const float* s0, const float* s1, float* C, int64_t ldc) {
  alignas(64) float cb[4][256];
  alignas(64) float acc[4][256];
  std::memset(acc, 0, sizeof(acc));  // (rows past M are read from the workspace padding, never stored)
  const uint8_t* a0 = A.data + int64_t(m) * A.ld;
  const uint8_t* a1 = a0 + 16 * A.ld;
  const int kpg = G / 32;  // tile depths (32 bf16 values) per group
  const int rows = imin(32, M - m);
  const int nq = rows > 16 ? 4 : 2;  // rows 16..31 only when there are any
  const int rows16 = rows > 16 ? 16 : rows;  // valid rows of the first tile row block
  for (int g = 0; g < Kd / G; ++g) {
    _tile_zero(0);
    _tile_zero(1);
    if (nq == 4) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int kt = g * kpg; kt < (g + 1) * kpg; ++kt) {
      _tile_loadd(4, a0 + kt * 64, A.ld);
      _tile_loadd(6, b0 + kt * 512, 64);
      _tile_loadd(7, b1 + kt * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (nq == 4) {
        _tile_loadd(5, a1 + kt * 64, A.ld);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, cb[0], 64);
    _tile_stored(1, cb[1], 64);
    if (nq == 4) {
      _tile_stored(2, cb[2], 64);
      _tile_stored(3, cb[3], 64);
    }
    const __m512 v0 = _mm512_set1_ps(s0[g]), v1 = _mm512_set1_ps(s1[g]);
    for (int q = 0; q < nq; ++q) {
      const __m512 vs = q & 1 ? v1 : v0;
      for (int i = 0; i < (q < 2 ? rows16 : rows - 16) * 16; i += 16)
        _mm512_store_ps(acc[q] + i, _mm512_fmadd_ps(_mm512_load_ps(cb[q] + i), vs, _mm512_load_ps(acc[q] + i)));
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < 2; ++j)
      std::memcpy(C + int64_t(m + r) * ldc + j * 16, acc[(r / 16) * 2 + j] + (r % 16) * 16, 64);
}

// The widened (bf16) copy of one item's block pair, per thread.
struct Fp8Scratch {
  uint16_t* p = nullptr;
  size_t cap = 0;
  ~Fp8Scratch() { std::free(p); }
  uint16_t* get(size_t n) {
    if (n > cap) {
      std::free(p);
      p = static_cast<uint16_t*>(std::aligned_alloc(64, (n * 2 + 63) / 64 * 64));
      if (!p) throw std::bad_alloc();
      cap = n;
    }
    return p;
  }
};
thread_local Fp8Scratch t_fp8;

void gemm_fp8(const PackedMat& W, int e, const ActView& A, int M, int nb0, int nb1, float* C, int64_t ldc, int G) {
  const uint8_t* base = W.data + int64_t(e) * W.expert_stride;
  const int64_t steps = W.Kd / 2, ng = W.Kd / G;  // 32-byte steps per block, groups per row
  uint16_t* wide = t_fp8.get(size_t(2 * steps * 32));
  for (int nb = nb0; nb < nb1; nb += 2) {
    avx512::fp8_to_bf16(base + int64_t(nb) * 16 * W.Kd, wide, 2 * steps);  // the two blocks are adjacent
    const float* sc = W.scale + (int64_t(e) * (W.N / 16) + nb) * ng;
    for (int m = 0; m < M; m += 32)
      amx_fp8_pair(wide, wide + steps * 32, W.Kd, G, A, m, M, sc, sc + ng, C + (nb - nb0) * 16, ldc);
  }
}

void gemm(int method, const PackedMat& W, int e, const ActView& A, int M, int nb0, int nb1, float* C, int64_t ldc,
          int G) {
  if (method == M_INT4 || M < (method == M_FP8 ? AMX_MIN_ROWS_FP8 : AMX_MIN_ROWS))
    return avx512::gemm(method, W, e, A, M, nb0, nb1, C, ldc, G);
  configure_tiles();
  if (method == M_FP8) return gemm_fp8(W, e, A, M, nb0, nb1, C, ldc, G);
  const uint8_t* base = W.data + int64_t(e) * W.expert_stride;
  const int64_t bbytes = method == M_INT8 ? int64_t(16) * W.Kd : int64_t(32) * W.Kd;
  // Block pairs outer, 32-row passes inner: a pair (2 x 16 x Kd bytes, <= 256 KiB at Kd 7168) is read
  // from DRAM once and served from L2 to the item's other passes; the M activation rows stay in L2/L3.
  // (Rows outer re-read every pair from DRAM once per 32 rows: 4x the weight traffic at 128 rows.)
  for (int nb = nb0; nb < nb1; nb += 2) {
    const uint8_t* b0 = base + nb * bbytes;
    float* Cb = C + (nb - nb0) * 16;
    const int64_t so = int64_t(e) * W.N + nb * 16;
    for (int m = 0; m < M; m += 32) {
      const int pf = m == 0 ? A.prefetch : 0;
      if (method == M_INT8)
        amx_pair<true>(b0, b0 + bbytes, W.Kd, A, m, M, W.scale + so, W.scale + so + 16, W.wsum + so,
                       W.wsum + so + 16, Cb, ldc, pf);
      else
        amx_pair<false>(b0, b0 + bbytes, W.Kd, A, m, M, nullptr, nullptr, nullptr, nullptr, Cb, ldc, pf);
    }
  }
}

const Kernels kTableAmx = {"amx", avx512::act_row_bytes, avx512::quant_row, gemm, nullptr};

}  // namespace
}  // namespace hm

extern "C" const hm::Kernels* hm_kernels_amx() { return &hm::kTableAmx; }
