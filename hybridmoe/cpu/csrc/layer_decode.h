// The attention half of a decoder layer at decode in one native call (the CPU-only model path,
// hybridmoe/cpu/layer_decode.py): residual add + RMSNorm, the qkv GEMV, decode attention, the o_proj
// GEMV, residual add + RMSNorm, optionally the router GEMV of the MoE block that follows, and
// optionally that MoE block itself (plain softmax top-k routing of the router's logits, then the
// layer's MoE task). It only sequences the existing calls (hm_add_rmsnorm_bf16, hm_dense,
// hm_attn_decode, hm_topk_softmax, hm_run_task), so the results are those of the separate calls bit
// for bit; what it saves is ~8-12 Python -> native crossings and their wrappers a layer.
#pragma once
#include <cstdint>

#include "attn_decode.h"
#include "dense.h"
#include "moe.h"

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
  // The MoE block (moe.layer == nullptr: none, the caller runs it; needs the router GEMV with bf16
  // out): the router's logits [T][router.ldo] routed by hm_topk_softmax (softmax, top moe.K,
  // renormalized when moe_renorm) into moe.ids (int32, ids_dtype 0) and moe.weights, then moe run
  // as hm_run_task runs it (x = h2, out = the layer's output). moe_counts: int64 [E] per-expert
  // selection counts to add this call's ids to (the expert-distribution recorder's), or nullptr.
  HmTask moe;
  int64_t* moe_counts;
  int32_t moe_renorm, pad2_;
};

// A run of decoder layers at decode in one call (hm_layers_decode): the embeddings x, layer 0's input
// norm into h0 (layer 0's struct reads its x / h1 / qkv.x there, norm1_w nullptr, res2_in patched to
// x), each layer's struct as hm_layer_decode runs it with this step's attention metadata patched in
// (every layer of one model shares it), then the final norm of the last layer's output and residual
// (its moe.out and res2) into out. The layers' structs are chained by the caller once: layer i + 1
// reads the buffers layer i writes (its x = layer i's moe.out, res_in = res2), which it consumes in
// its input norm before it writes them again, so one pair of buffers serves every layer.
struct HmDecodeStack {           // mirrored by hybridmoe/cpu/layer_decode.py DecodeStack
  const uint16_t* x;             // bf16 [T][H] this step's embeddings
  const uint16_t* norm0_w;       // bf16 [H] layer 0's input_layernorm
  uint16_t* h0;                  // bf16 [T][H] layer 0's normed input
  const uint16_t* normf_w;       // bf16 [H] the final norm
  uint16_t* res_f;               // bf16 [T][H] the final residual (scratch)
  uint16_t* out;                 // bf16 [T][H] the final norm's output
  const int64_t* positions;      // the attention metadata of HmAttnDecode, for every layer
  const int64_t* slots;
  const int32_t* block_table;
  const int32_t* seq_lens;
  int64_t ld_bt, T, H;
  float eps0, epsf;
  int32_t n, pad_;               // n layers
};
}

