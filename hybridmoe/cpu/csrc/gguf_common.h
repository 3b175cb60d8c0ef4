// GGUF expert layers (--kt-method LLAMAFILE): the C ABI descriptor and what the GGUF kernel units
// share. Weights stay in the GGUF file's block layout (hybridmoe/cpu/gguf_quant.py documents every
// type); the kernels unpack the blocks of a 16-row N-block into "UBlk"s (unsigned or signed bytes +
// per-4-value float scales + per-16-value float bias) once per GEMM item and reuse them for every
// activation row of the item, so decode streams each weight byte once and large T reuses the
// unpacked tile from L2 (the cache-blocked path).
//
// Legend: T tokens, E experts, H hidden, I intermediate, K reduction size (a multiple of 256),
// B = K / 256 super-blocks per row, v value index inside a super-block, g = v / 16.
//
// Activation row (one token, or one (token, expert) slot), Kp = K values, "Q8_K-style":
//   q  int8 [Kp]        q = rint(x * 127 / amax), per 256 values
//   bs f32 [Kp / 16]    sum of the 16 q of each group (exact integers)
//   d  f32 [Kp / 256]   amax / 127
//   bi i16 [Kp / 16]    the same group sums as int16 (the direct kernels' madd with int16 mins)
//   (zero pad to a multiple of 64 bytes)
//   qp int8 [Kp]        q with the 32-value sub-blocks of each 256 in the order 0 2 1 3 4 6 5 7: the
//                       AVX-512 Q4_K / Q5_K kernels' order (the low nibbles of 64 bytes of qs are
//                       sub-blocks 2j, 2j + 2, the high nibbles 2j + 1, 2j + 3)
//   b32 i16 [Kp / 32]   sum of the 32 q of each sub-block (natural order; Q4_K / Q5_K mins)
// Dot of a weight row with an activation row, per super-block b:
//   d_b * ( sum_{v/4} sl[v/4] * (sum of 4 u_v q_v)  +  sum_g bias[g] * bs[g] )
// where the weight value w_v = S_g * u_v + bias_g (S_g, bias_g per group of 16; sl = S per 4 values).
// That is the cache-blocked (tile) path of many rows; few rows per expert (decode) take the direct
// kernels instead (gguf_dot512.h / gguf_dot256.h), which unpack the packed blocks in registers.
#pragma once
#include <cstdint>

#include "common.h"

extern "C" {
struct HmGgufMat {            // one stacked expert matrix [E, N, K] as the file stores it
  const uint8_t* data;        // expert e, row n at data + e * expert_stride + n * row_bytes
  int64_t expert_stride;      // bytes
  int64_t row_bytes;          // bytes of one row of K values
  int32_t type;               // GGML type id (GG_* below)
  int32_t N, K, pad_;
};
struct HmGgufDesc {
  int32_t E, H, I, act;
  float act_alpha, act_limit;
  HmGgufMat gate, up, down;   // gate/up [E, I, H], down [E, H, I]
};
}

namespace hm {

constexpr int M_GGUF = 4;  // LayerDesc.method of a GGUF layer (only hm_gguf_layer_create makes one)
enum GgufType : int { GG_Q4_0 = 2, GG_Q8_0 = 8, GG_Q4_K = 12, GG_Q5_K = 13, GG_Q6_K = 14, GG_IQ4_XS = 23 };

// LayerDesc.w13.data / w2.data of a GGUF layer point at one of these (the kernels' view).
struct GgufPair {
  const HmGgufMat* a;  // w13: gate (even N-blocks), w2: down
  const HmGgufMat* b;  // w13: up (odd N-blocks), w2: nullptr
};

struct alignas(64) UBlk {
  uint8_t u[256];   // values: unsigned (or signed for Q8_0 / IQ4_XS on AVX2, see gguf_unpack.h)
  float sl[64];     // scale of values 4j..4j+3
  float bias[16];   // bias of group g (times the activation group sum)
};

inline int64_t gguf_act_qp_offset(int Kp) {
  return round_up(int64_t(Kp) + int64_t(Kp) / 16 * 4 + Kp / 256 * 4 + int64_t(Kp) / 16 * 2, 64);
}
inline int64_t gguf_act_row_bytes(int Kp) { return round_up(gguf_act_qp_offset(Kp) + Kp + Kp / 32 * 2, 64); }

// Rows per expert up to which a GEMM item takes the direct kernels. Measured on one 256-row Q4_K /
// Q8_0 matrix, K = 2048, hot in L2 (AVX-512): direct 0.5x the tile path's time at 32 rows, 0.8-0.9x
// at 64, equal at 128, 1.2-1.3x at 256. That was the row-major tile path; the AVX-512 step-layout one
// (session 24) is 1.5-1.9x faster at 256 rows an expert, but 32 in place of 64 measured mixed (2-core Zen 4,
// T 256 / 1024 of the Qwen3-30B-A3B layer: Q4_K and Q8_0 +0-5%, Q6_K 0.7x), so 64 stays.
constexpr int kGgufDirectRows = 64;

// Bytes per row of K values for a type, or -1 when unknown / K not a multiple of 256.
inline int64_t gguf_row_bytes(int type, int K) {
  if (K <= 0 || K % 256) return -1;
  switch (type) {
    case GG_Q4_0: return int64_t(K) / 32 * 18;
    case GG_Q8_0: return int64_t(K) / 32 * 34;
    case GG_Q4_K: return int64_t(K) / 256 * 144;
    case GG_Q5_K: return int64_t(K) / 256 * 176;
    case GG_Q6_K: return int64_t(K) / 256 * 210;
    case GG_IQ4_XS: return int64_t(K) / 256 * 136;
  }
  return -1;
}

inline bool gguf_signed(int type) { return type == GG_Q8_0 || type == GG_IQ4_XS; }

}  // namespace hm

extern "C" const hm::Kernels* hm_kernels_gguf_avx2() __attribute__((weak));
extern "C" const hm::Kernels* hm_kernels_gguf_avx512() __attribute__((weak));
extern "C" const hm::Kernels* hm_kernels_gguf_amx() __attribute__((weak));
extern "C" const hm::Kernels* hm_kernels_gguf_amx_emu() __attribute__((weak));
