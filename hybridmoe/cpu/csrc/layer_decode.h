// The attention half of a decoder layer at decode in one native call (the CPU-only model path,
// hybridmoe/cpu/layer_decode.py): residual add + RMSNorm, the qkv GEMV, decode attention, the o_proj
// GEMV, residual add + RMSNorm, and optionally the router GEMV of the MoE block that follows. It only
// sequences the existing calls (hm_add_rmsnorm_bf16, hm_dense, hm_attn_decode), so the results are
// those of the separate calls bit for bit; what it saves is ~8 Python -> native crossings and their
// wrappers a layer.
#pragma once
#include <cstdint>

#include "attn_decode.h"
#include "dense.h"

extern "C" {
struct HmLayerDecode {           // mirrored by hybridmoe/cpu/layer_decode.py LayerDecode
  const uint16_t* x;             // bf16 [T][H]: the previous layer's output, or (norm1_w == nullptr) the normed input
  const uint16_t* res_in;        // bf16 [T][H] the residual stream (unused without norm1_w)
  const uint16_t* norm1_w;       // bf16 [H] input_layernorm, or nullptr: x is already normed (the first layer)
  uint16_t* res1;                // bf16 [T][H] x + res_in (unused without norm1_w)
  uint16_t* h1;                  // bf16 [T][H] the normed attention input (may be x's buffer only without norm1_w)
  const uint16_t* norm2_w;       // bf16 [H] post_attention_layernorm
  const uint16_t* res2_in;       // bf16 [T][H] the residual before the attention: res1, or x without norm1_w
  uint16_t* res2;                // bf16 [T][H] o + res2_in: the residual after the attention
  uint16_t* h2;                  // bf16 [T][H] the normed FFN input
  HmDenseTask qkv;               // x = h1, out = attn.qkv
  HmAttnDecode attn;             // out = o.x
  HmDenseTask o;                 // out: [T][H] bf16, added to res2_in by the second norm
  HmDenseTask router;            // x = h2 (N == 0: none)
  int64_t T, H;
  float eps1, eps2;
  int32_t isa, pad_;
};
}
