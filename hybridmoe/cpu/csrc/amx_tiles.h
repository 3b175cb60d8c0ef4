// The AMX tile operations moe_amx.cpp uses, as hm_tile_*: the hardware intrinsics, or, compiled with
// HM_AMX_EMULATE (moe_amx_emu.cpp), a software model of the same operations on AVX-512 VNNI/BF16.
//
// Why a model: the AMX kernels' logic (tile shapes, the B-tile layout of the packed blocks, group
// scales, rows past M) is otherwise tested only on a host with AMX, and CI machines have none. The
// model runs that logic on any AVX-512 machine (HYBRIDMOE_AMX_EMULATE=1; dispatch.cpp), and checks
// what the hardware would fault on: an op before LDTILECFG, and shapes the configuration does not
// allow (dot K / M / N mismatches, a tile index past 7). It models the arithmetic, not the speed:
// each tile dot is 16 x K/4 VNNI (or BF16 dot) instructions on 16 int32 / fp32 lanes.
#pragma once
#include <immintrin.h>

#include <cstdint>

#ifndef HM_AMX_EMULATE

#define hm_tile_loadconfig(cfg) _tile_loadconfig(cfg)
#define hm_tile_zero(t) _tile_zero(t)
#define hm_tile_loadd(t, p, stride) _tile_loadd(t, p, stride)
#define hm_tile_stored(t, p, stride) _tile_stored(t, p, stride)
#define hm_tile_dpbusd(c, a, b) _tile_dpbusd(c, a, b)  // u8 A x s8 B -> int32
#define hm_tile_dpbsud(c, a, b) _tile_dpbsud(c, a, b)  // s8 A x u8 B -> int32
#define hm_tile_dpbssd(c, a, b) _tile_dpbssd(c, a, b)  // s8 A x s8 B -> int32
#define hm_tile_dpbf16ps(c, a, b) _tile_dpbf16ps(c, a, b)  // bf16 pairs -> fp32

#else

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace hm {
namespace amx_emu {

struct Tile {
  int rows = 0, colsb = 0;
  alignas(64) uint8_t d[16][64];
};

struct State {
  bool configured = false;
  Tile t[8];
};

inline thread_local State g_state;

[[noreturn]] inline void fault(const char* what) {
  std::fprintf(stderr, "hybridmoe AMX emulation: %s (the hardware would raise #UD)\n", what);
  std::abort();
}

inline Tile& tile(int i) {
  if (!g_state.configured) fault("tile op before LDTILECFG");
  if (i < 0 || i > 7) fault("tile index out of range");
  return g_state.t[i];
}

// LDTILECFG's 64-byte operand: palette (byte 0), colsb[16] (uint16 at 16), rows[16] (uint8 at 48).
inline void loadconfig(const void* cfg) {
  const uint8_t* c = static_cast<const uint8_t*>(cfg);
  if (c[0] == 0) {  // palette 0: release
    g_state.configured = false;
    return;
  }
  if (c[0] != 1) fault("palette other than 1");
  for (int i = 0; i < 8; ++i) {
    uint16_t colsb;
    std::memcpy(&colsb, c + 16 + 2 * i, 2);
    const int rows = c[48 + i];
    if (colsb > 64 || rows > 16 || colsb % 4) fault("tile shape beyond 16 rows x 64 bytes");
    g_state.t[i].rows = rows;
    g_state.t[i].colsb = colsb;
    std::memset(g_state.t[i].d, 0, sizeof(g_state.t[i].d));
  }
  g_state.configured = true;
}

inline void zero(int i) { std::memset(tile(i).d, 0, sizeof(Tile::d)); }

inline void loadd(int i, const void* p, int64_t stride) {
  Tile& t = tile(i);
  std::memset(t.d, 0, sizeof(t.d));
  for (int r = 0; r < t.rows; ++r) std::memcpy(t.d[r], static_cast<const uint8_t*>(p) + r * stride, size_t(t.colsb));
}

inline void stored(int i, void* p, int64_t stride) {
  const Tile& t = tile(i);
  for (int r = 0; r < t.rows; ++r) std::memcpy(static_cast<uint8_t*>(p) + r * stride, t.d[r], size_t(t.colsb));
}

// C[M x N] (4-byte elements) += A[M x K quads] . B[K quads x N], as the hardware checks it.
inline void check_dot(const Tile& c, const Tile& a, const Tile& b) {
  if (c.rows != a.rows) fault("dot: C rows != A rows");
  if (c.colsb != b.colsb) fault("dot: C bytes per row != B bytes per row");
  if (a.colsb / 4 != b.rows) fault("dot: A bytes per row / 4 != B rows");
}

inline __mmask16 lanes(const Tile& c) { return __mmask16((1u << (c.colsb / 4)) - 1); }

inline int32_t quad(const Tile& a, int m, int k) {
  int32_t v;
  std::memcpy(&v, a.d[m] + 4 * k, 4);
  return v;
}

// kind 0: u8 A x s8 B (TDPBUSD); 1: s8 A x u8 B (TDPBSUD; VPDPBUSD with the operands' roles swapped:
// its u8 operand is B's row, its s8 operand the broadcast A quad, the same products); 2: s8 A x s8 B
// (TDPBSSD; VNNI has no s8 x s8 dot: B's row with its sign bit flipped is b + 128 as u8, so VPDPBUSD gives
// sum a (b + 128), and 128 times the quad's sum of a is taken off after, exact in int32).
template <int KIND>
inline void dp_int8(int ci, int ai, int bi) {
  Tile &c = tile(ci), &a = tile(ai), &b = tile(bi);
  check_dot(c, a, b);
  const __mmask16 mk = lanes(c);
  for (int m = 0; m < c.rows; ++m) {
    __m512i acc = _mm512_maskz_loadu_epi32(mk, c.d[m]);
    for (int k = 0; k < b.rows; ++k) {
      const int32_t q = quad(a, m, k);
      const __m512i x = _mm512_set1_epi32(q), w = _mm512_loadu_si512(b.d[k]);
      if (KIND == 0) {
        acc = _mm512_dpbusd_epi32(acc, x, w);
      } else if (KIND == 1) {
        acc = _mm512_dpbusd_epi32(acc, w, x);
      } else {
        const int qsum = int8_t(q) + int8_t(q >> 8) + int8_t(q >> 16) + int8_t(q >> 24);
        acc = _mm512_dpbusd_epi32(acc, _mm512_xor_si512(w, _mm512_set1_epi8(char(0x80))), x);
        acc = _mm512_sub_epi32(acc, _mm512_set1_epi32(128 * qsum));
      }
    }
    _mm512_mask_storeu_epi32(c.d[m], mk, acc);
  }
}

inline void dp_bf16(int ci, int ai, int bi) {
  Tile &c = tile(ci), &a = tile(ai), &b = tile(bi);
  check_dot(c, a, b);
  const __mmask16 mk = lanes(c);
  for (int m = 0; m < c.rows; ++m) {
    __m512 acc = _mm512_maskz_loadu_ps(mk, c.d[m]);
    for (int k = 0; k < b.rows; ++k)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(quad(a, m, k)), (__m512bh)_mm512_loadu_si512(b.d[k]));
    _mm512_mask_storeu_ps(c.d[m], mk, acc);
  }
}

}  // namespace amx_emu
}  // namespace hm

#define hm_tile_loadconfig(cfg) ::hm::amx_emu::loadconfig(cfg)
#define hm_tile_zero(t) ::hm::amx_emu::zero(t)
#define hm_tile_loadd(t, p, stride) ::hm::amx_emu::loadd(t, p, stride)
#define hm_tile_stored(t, p, stride) ::hm::amx_emu::stored(t, p, stride)
#define hm_tile_dpbusd(c, a, b) ::hm::amx_emu::dp_int8<0>(c, a, b)
#define hm_tile_dpbsud(c, a, b) ::hm::amx_emu::dp_int8<1>(c, a, b)
#define hm_tile_dpbssd(c, a, b) ::hm::amx_emu::dp_int8<2>(c, a, b)
#define hm_tile_dpbf16ps(c, a, b) ::hm::amx_emu::dp_bf16(c, a, b)

#endif
