// One decode step of standard (GQA) attention on the CPU for the CPU-only model path: per-head
// q/k RMSNorm and RoPE of the fused qkv row, the new k/v stored into the paged cache, attention of
// each sequence's one new token over its cached tokens, in one native call per layer instead of
// ~30 small torch ops (hybridmoe/cpu/attn_decode.py installs it). bf16 activations, weights and
// cache; the norm and RoPE round to bf16 where torch's reference does (fused_ops.qk_norm_rope_ref:
// the same values up to the order of the norm's sum), scores, softmax and the weighted sum in fp32.
#pragma once
#include <cstdint>

extern "C" {
struct HmAttnDecode {            // mirrored by hybridmoe/cpu/attn_decode.py AttnDecode
  const uint16_t* qkv;           // bf16 [B][ld_qkv]: q (Hq*D) | k (Hkv*D) | v (Hkv*D)
  const uint16_t* q_norm;        // bf16 [D] per-head RMSNorm weight, or nullptr (no q/k norm)
  const uint16_t* k_norm;
  const float* cos;              // fp32 [max_pos][D/2]
  const float* sin;
  const int64_t* positions;      // [B]
  uint16_t* k_cache;             // bf16 [N][S][Hkv][D]
  uint16_t* v_cache;
  const int64_t* slots;          // [B] flat cache slot of each new token
  const int32_t* block_table;    // [B][ld_bt] page ids
  const int32_t* seq_lens;       // [B] cached + new tokens
  uint16_t* out;                 // bf16 [B][ld_out]: Hq*D per sequence
  int64_t ld_qkv, ld_bt, ld_out;
  int32_t B, Hq, Hkv, D, S, pad_;
  float eps, scale;
};
}

namespace hm {
using AttnDecodeFn = void (*)(const HmAttnDecode& a);
}

extern "C" hm::AttnDecodeFn hm_attn_decode_avx2() __attribute__((weak));
