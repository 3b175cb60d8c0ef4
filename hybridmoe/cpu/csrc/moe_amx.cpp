// AMX kernels (tile + int8 + bf16) for many rows per expert; small row counts (and int4 with group 32) use
// the AVX-512 kernels (same activation formats: u8 = q + 128 for int8, s8 q for int4, bf16 rows for BF16
// and FP8).
// FP8: each K group of a block pair is widened to bf16 once per item (fp8_to_bf16: the B-tile layout,
// exact) and reused by all its rows; its tile dots are scaled by the group's scale into fp32 sums.
// INT4 the same way: each K group of a block pair is unpacked once per item to one nibble per byte (the
// int8 B-tile layout), its tile dots with the s8 activations summed in int32 and scaled per group into
// fp32 sums (group_passes below).
// Tiles: C0..C3 = 32 rows x 32 outputs (int32 / fp32), A4/A5 = 2 x 16 activation rows,
// B6/B7 = two N-blocks; the packed block layout is exactly the AMX B-tile (VNNI) layout, so a B
// tile is 1 KiB of contiguous weights. Rows past M are read from the workspace padding and dropped.
// The tile ops are amx_tiles.h's hm_tile_*: the hardware's, or (moe_amx_emu.cpp) a software model of
// them, so that this file's logic is tested on machines without AMX too.
#include <immintrin.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include "amx_tiles.h"
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
  hm_tile_loadconfig(&cfg);
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
  hm_tile_zero(0);
  hm_tile_zero(1);
  hm_tile_zero(2);
  hm_tile_zero(3);
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
    hm_tile_loadd(4, a0 + kt * 64, A.ld);
    hm_tile_loadd(5, a1 + kt * 64, A.ld);
    hm_tile_loadd(6, b0 + kt * 1024, 64);
    hm_tile_loadd(7, b1 + kt * 1024, 64);
    if (INT8) {
      hm_tile_dpbusd(0, 4, 6);
      hm_tile_dpbusd(1, 4, 7);
      hm_tile_dpbusd(2, 5, 6);
      hm_tile_dpbusd(3, 5, 7);
    } else {
      hm_tile_dpbf16ps(0, 4, 6);
      hm_tile_dpbf16ps(1, 4, 7);
      hm_tile_dpbf16ps(2, 5, 6);
      hm_tile_dpbf16ps(3, 5, 7);
    }
  }
  hm_tile_stored(0, cb[0], 64);
  hm_tile_stored(1, cb[1], 64);
  hm_tile_stored(2, cb[2], 64);
  hm_tile_stored(3, cb[3], 64);
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

// The widened (bf16) or unpacked (int4 -> s8 / u8) copy of one K group of a block pair, per thread.
struct WideScratch {
  uint8_t* p = nullptr;
  size_t cap = 0;
  ~WideScratch() { std::free(p); }
  uint8_t* get(size_t bytes) {
    if (bytes > cap) {
      std::free(p);
      p = static_cast<uint8_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
      if (!p) throw std::bad_alloc();
      cap = bytes;
    }
    return p;
  }
};
thread_local WideScratch t_wide;
thread_local WideScratch t_acc;  // the fp32 sums of every 32-row pass of one block pair ([passes][4][256])

// FP8 and INT4 have a scale per K group (and output), so their tile dots are stored and scaled into fp32 sums
// once per group. They share one loop, for each block pair of an item:
//   for each K group g: prep(g) writes the group's two B blocks in the tile layout to `wide` (kpg tile depths of
//     1 KiB each, block 0's then block 1's);
//     for each 32-row pass: the tile dots of the group (A: a_gbytes of each row a group), then fold(...) adds
//     them, scaled, to the pass's fp32 sums acc[pass].
// - The group's B (2 kpg KiB: 4 KiB for INT4 at G 128, 8 KiB for FP8 at G 128) stays in L1 for all passes. (The
//   loop before session 40 widened or unpacked the whole pair first, 32 Kd (INT4) or 64 Kd (FP8) bytes, and read it
//   back from L2 on every pass: 64 / 128 KiB at Kd 2048, 229 / 458 KiB at DeepSeek-V3's 7168.)
// - The fold of one (group, pass) runs on the vector units while the tile unit computes the next one's dots: the
//   dots are issued first, then the previous (group, pass)'s stored dots are folded, then the tiles are stored
//   (the stores wait for the dots).
// Rows past M are read from the workspace padding and dropped.

// Issue the tile dots of K depths [0, kpg) into C0..C3 (nq 4; C0, C1 when nq is 2), zeroed first; not stored.
// DOT: 0 bf16 pairs (TDPBF16PS), 1 s8 A x u8 B (TDPBSUD), 2 s8 A x s8 B (TDPBSSD).
template <int DOT>
inline void issue_dots(const uint8_t* a0, const uint8_t* a1, int64_t lda, const uint8_t* b0, const uint8_t* b1,
                       int kpg, int nq) {
  hm_tile_zero(0);
  hm_tile_zero(1);
  if (nq == 4) {
    hm_tile_zero(2);
    hm_tile_zero(3);
  }
  for (int kt = 0; kt < kpg; ++kt) {
    hm_tile_loadd(4, a0 + kt * 64, lda);
    hm_tile_loadd(6, b0 + kt * 1024, 64);
    hm_tile_loadd(7, b1 + kt * 1024, 64);
    if (DOT == 0) {
      hm_tile_dpbf16ps(0, 4, 6);
      hm_tile_dpbf16ps(1, 4, 7);
    } else if (DOT == 1) {
      hm_tile_dpbsud(0, 4, 6);
      hm_tile_dpbsud(1, 4, 7);
    } else {
      hm_tile_dpbssd(0, 4, 6);
      hm_tile_dpbssd(1, 4, 7);
    }
    if (nq == 4) {
      hm_tile_loadd(5, a1 + kt * 64, lda);
      if (DOT == 0) {
        hm_tile_dpbf16ps(2, 5, 6);
        hm_tile_dpbf16ps(3, 5, 7);
      } else if (DOT == 1) {
        hm_tile_dpbsud(2, 5, 6);
        hm_tile_dpbsud(3, 5, 7);
      } else {
        hm_tile_dpbssd(2, 5, 6);
        hm_tile_dpbssd(3, 5, 7);
      }
    }
  }
}

inline void store_dots(int nq, int32_t (*cb)[256]) {
  hm_tile_stored(0, cb[0], 64);
  hm_tile_stored(1, cb[1], 64);
  if (nq == 4) {
    hm_tile_stored(2, cb[2], 64);
    hm_tile_stored(3, cb[3], 64);
  }
}

// The loop above for one block pair. fold(cb, acc, rows, m, g): the stored dots cb of group g and the pass at row
// m (rows of it) into acc [4][256].
template <int DOT, class Prep, class Fold>
inline void group_passes(const ActView& A, int M, int ng, int kpg, int64_t a_gbytes, const uint8_t* wide,
                         float (*acc)[4][256], Prep&& prep, Fold&& fold) {
  alignas(64) int32_t cb[2][4][256];
  const int passes = (M + 31) / 32;
  int prev_g = -1, prev_p = 0, buf = 0;  // the (group, pass) whose stored dots wait in cb[buf ^ 1]
  for (int g = 0; g < ng; ++g) {
    prep(g);
    for (int p = 0; p < passes; ++p) {
      const int m = p * 32, nq = M - m > 16 ? 4 : 2;
      const uint8_t* a0 = A.data + int64_t(m) * A.ld + g * a_gbytes;
      issue_dots<DOT>(a0, a0 + 16 * A.ld, A.ld, wide, wide + 1024 * kpg, kpg, nq);
      if (prev_g >= 0) fold(cb[buf ^ 1], acc[prev_p], imin(32, M - prev_p * 32), prev_p * 32, prev_g);
      store_dots(nq, cb[buf]);
      prev_g = g, prev_p = p, buf ^= 1;
    }
  }
  if (prev_g >= 0) fold(cb[buf ^ 1], acc[prev_p], imin(32, M - prev_p * 32), prev_p * 32, prev_g);
}

// acc [passes][4][256] -> C rows [0, M) x 32 outputs, each row times its scale (sx: nullptr for none).
inline void store_sums(const float (*acc)[4][256], int M, const float* sx, float* C, int64_t ldc) {
  for (int r = 0; r < M; ++r) {
    const __m512 s = _mm512_set1_ps(sx ? sx[r] : 1.0f);
    const float* a = acc[r / 32][((r % 32) / 16) * 2] + (r % 16) * 16;
    _mm512_storeu_ps(C + int64_t(r) * ldc, _mm512_mul_ps(_mm512_load_ps(a), s));
    _mm512_storeu_ps(C + int64_t(r) * ldc + 16, _mm512_mul_ps(_mm512_load_ps(a + 256), s));
  }
}

inline float (*pass_sums(int M))[4][256] {
  const size_t bytes = size_t((M + 31) / 32) * sizeof(float[4][256]);
  auto* acc = reinterpret_cast<float (*)[4][256]>(t_acc.get(bytes));
  std::memset(acc, 0, bytes);
  return acc;
}

// FP8: the blocks widened to bf16 (fp8_to_bf16: the B-tile layout, exact), dotted with the bf16 activation rows
// (TDPBF16PS) and scaled by the block's scale of the group [Kd/G] (one a block of 16 outputs).
void gemm_fp8(const PackedMat& W, int e, const ActView& A, int M, int nb0, int nb1, float* C, int64_t ldc, int G) {
  const uint8_t* base = W.data + int64_t(e) * W.expert_stride;
  const int64_t Kd = W.Kd, ng = Kd / G;
  const int kpg = G / 32;  // tile depths (32 bf16 values: 512 fp8 bytes of a block, 16 steps of 32) per group
  uint8_t* wide = t_wide.get(size_t(2048) * kpg);
  auto* w16 = reinterpret_cast<uint16_t*>(wide);
  for (int nb = nb0; nb < nb1; nb += 2) {
    const uint8_t* blk0 = base + int64_t(nb) * 16 * Kd;  // 16 Kd fp8 bytes a block, the two adjacent
    const float* sc = W.scale + (int64_t(e) * (W.N / 16) + nb) * ng;
    auto* acc = pass_sums(M);
    group_passes<0>(
        A, M, int(ng), kpg, int64_t(kpg) * 64, wide, acc,
        [&](int g) {
          avx512::fp8_to_bf16(blk0 + int64_t(g) * 512 * kpg, w16, 16 * kpg);
          avx512::fp8_to_bf16(blk0 + 16 * Kd + int64_t(g) * 512 * kpg, w16 + 512 * kpg, 16 * kpg);
        },
        [&](const int32_t (*cb)[256], float (*a)[256], int rows, int, int g) {
          const __m512 vs[2] = {_mm512_set1_ps(sc[g]), _mm512_set1_ps(sc[ng + g])};
          const int nq = rows > 16 ? 4 : 2, rows16 = rows > 16 ? 16 : rows;
          for (int q = 0; q < nq; ++q) {
            const float* c = reinterpret_cast<const float*>(cb[q]);
            for (int i = 0; i < (q < 2 ? rows16 : rows - 16) * 16; i += 16)
              _mm512_store_ps(a[q] + i, _mm512_fmadd_ps(_mm512_load_ps(c + i), vs[q & 1], _mm512_load_ps(a[q] + i)));
          }
        });
    store_sums(acc, M, nullptr, C + (nb - nb0) * 16, ldc);
  }
}

// `units` packed int4 units (64 bytes: steps 2u and 2u + 1 in the low and high nibbles) -> 2 * units
// int8-layout steps of one nibble a byte: u8 u (0..15), or with SIGNED s8 u - 8 (-8..7).
template <bool SIGNED>
void unpack_i4(const uint8_t* src, uint8_t* dst, int64_t units) {
  const __m512i mask = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
  for (int64_t u = 0; u < units; ++u) {
    const __m512i v = _mm512_loadu_si512(src + u * 64);
    __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    if (SIGNED) lo = _mm512_sub_epi8(lo, eight), hi = _mm512_sub_epi8(hi, eight);
    _mm512_store_si512(dst + u * 128, lo);
    _mm512_store_si512(dst + u * 128 + 64, hi);
  }
}

// INT4: d0/d1 (z0/z1: asymmetric) are the pair's group scales (and mins) [Kd/G][16]. Per K group g and row r
// (activation scale sx, group sum gs of its s8 q), S the group's int32 tile dot; sx applied once at the end:
// - sym (w = d (u - 8)): the blocks hold u - 8 as s8 (TDPBSSD): sx d S. (Unpacked as u8 u with TDPBSUD, each
//   row's group needed S - 8 gs: a broadcast load and a subtract more on every 16 sums of the per-group pass;
//   without them INT4 went from 0.83x to 0.96x of INT8's TFLOP/s at T 1024 and from 0.79x to 0.89x at T 4096,
//   H100 host, session 34.)
// - asym (w = d u + m): the blocks hold u as u8 (TDPBSUD): sx (d S + m gs).
template <bool ASYM>
void gemm_i4_pairs(const PackedMat& W, int e, const ActView& A, int M, int nb0, int nb1, float* C, int64_t ldc,
                   int G) {
  const uint8_t* base = W.data + int64_t(e) * W.expert_stride;
  const int64_t Kd = W.Kd, NBT = W.N / 16, ng = Kd / G;
  const int kpg = G / 64;  // tile depths (64 int8 values: 512 packed bytes of a block, 8 units) per group
  uint8_t* wide = t_wide.get(size_t(2048) * kpg);
  for (int nb = nb0; nb < nb1; nb += 2) {
    const uint8_t* blk0 = base + int64_t(nb) * 8 * Kd;  // packed: 8 Kd bytes a block, the two adjacent
    const int64_t so = (int64_t(e) * NBT + nb) * ng * 16;
    const float* d = W.scale + so;
    const float* z = ASYM ? W.zero + so : nullptr;
    auto* acc = pass_sums(M);
    group_passes<ASYM ? 1 : 2>(
        A, M, int(ng), kpg, G, wide, acc,
        [&](int g) {
          unpack_i4<!ASYM>(blk0 + int64_t(g) * 512 * kpg, wide, 8 * kpg);
          unpack_i4<!ASYM>(blk0 + 8 * Kd + int64_t(g) * 512 * kpg, wide + 1024 * kpg, 8 * kpg);
        },
        [&](const int32_t (*cb)[256], float (*a)[256], int rows, int m, int g) {
          const __m512 vd[2] = {_mm512_loadu_ps(d + g * 16), _mm512_loadu_ps(d + (ng + g) * 16)};
          __m512 vz[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
          if (ASYM) vz[0] = _mm512_loadu_ps(z + g * 16), vz[1] = _mm512_loadu_ps(z + (ng + g) * 16);
          const int nq = rows > 16 ? 4 : 2, rows16 = rows > 16 ? 16 : rows;
          for (int q = 0; q < nq; ++q) {
            const int j = q & 1, r0 = (q >> 1) * 16, nr = q < 2 ? rows16 : rows - 16;
            const int32_t* gs = A.gsum + int64_t(m + r0) * A.gstride + g;
            for (int r = 0; r < nr; ++r) {
              const __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512(cb[q] + r * 16));
              float* acc_r = a[q] + r * 16;
              const __m512 f = _mm512_fmadd_ps(s, vd[j], _mm512_load_ps(acc_r));
              _mm512_store_ps(acc_r, ASYM ? _mm512_fmadd_ps(vz[j], _mm512_set1_ps(float(gs[r * A.gstride])), f) : f);
            }
          }
        });
    store_sums(acc, M, A.scale, C + (nb - nb0) * 16, ldc);
  }
}

void gemm_i4(const PackedMat& W, int e, const ActView& A, int M, int nb0, int nb1, float* C, int64_t ldc, int G) {
  if (W.zero)
    gemm_i4_pairs<true>(W, e, A, M, nb0, nb1, C, ldc, G);
  else
    gemm_i4_pairs<false>(W, e, A, M, nb0, nb1, C, ldc, G);
}

void gemm(int method, const PackedMat& W, int e, const ActView& A, int M, int nb0, int nb1, float* C, int64_t ldc,
          int G) {
  if (M < (method == M_FP8 ? AMX_MIN_ROWS_FP8 : AMX_MIN_ROWS) || (method == M_INT4 && G % 64))
    return avx512::gemm(method, W, e, A, M, nb0, nb1, C, ldc, G);
  configure_tiles();
  if (method == M_FP8) return gemm_fp8(W, e, A, M, nb0, nb1, C, ldc, G);
  if (method == M_INT4) return gemm_i4(W, e, A, M, nb0, nb1, C, ldc, G);
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

#ifdef HM_AMX_EMULATE
const Kernels kTableAmx = {"amx-emulated", avx512::act_row_bytes, avx512::quant_row, gemm, nullptr};
#else
const Kernels kTableAmx = {"amx", avx512::act_row_bytes, avx512::quant_row, gemm, nullptr};
#endif

}  // namespace
}  // namespace hm

#ifdef HM_AMX_EMULATE
extern "C" const hm::Kernels* hm_kernels_amx_emu() { return &hm::kTableAmx; }
#else
extern "C" const hm::Kernels* hm_kernels_amx() { return &hm::kTableAmx; }
#endif
