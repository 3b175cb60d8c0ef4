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
// The kernels of decode attention, AVX2 (attn_decode.cpp); attn_pool.cpp spreads the (sequence b, kv head
// g) units of prep and finish, and the spans of positions, over the pool's threads.
struct AttnDecodeKernels {
  // q [G][D] fp32 := group g's G = Hq/Hkv query heads of sequence b, normed and rotated; the new token's k
  // (normed, rotated) and v of head g stored into the caches (before any span reads position L-1).
  void (*prep)(const HmAttnDecode& a, int b, int g, float* q);
  // Cached positions [l0, l1) of sequence b for kv heads [g0, g1) (each position's row of those heads
  // read once, in order): st + (g - g0) * st_stride = head g's state, [G] max score | [G] sum of
  // exp(score - max) | [G][D] sum of exp(score - max) * v (2G + G*D floats); q: those heads' prepared
  // queries, [g1 - g0][G][D]; sc: scratch of >= span_scratch(G, l1 - l0) floats.
  void (*span)(const HmAttnDecode& a, int b, int g0, int g1, const float* q, int64_t l0, int64_t l1, float* st,
               int64_t st_stride, float* sc);
  // The bf16 output of group g's heads from ns span states, st_stride floats apart (the softmax merge).
  void (*finish)(const HmAttnDecode& a, int b, int g, const float* st, int ns, int64_t st_stride);
};
// The softmax's exp in both units (exp8, exp16): 2^n * p(r), n = round(x log2 e), r = x - n ln2 (ln2 in two
// parts), p of degree 6 in Horner form from kExpPoly[0]; inputs below kExpMin give 0.
constexpr float kExpMin = -87.0f, kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
// Scratch floats a span of n positions needs (G query heads a kv head).
inline int64_t span_scratch(int G, int64_t n) { return int64_t(G < 16 ? 16 : G) * (n + 16); }
}  // namespace hm

extern "C" const hm::AttnDecodeKernels* hm_attn_decode_kernels_avx2() __attribute__((weak));
// The AVX-512 (F, BW, VL, BF16) span for G <= 32 (attn_decode_avx512.cpp: AttnDecodeKernels::span's contract,
// no scratch); false: not for this G. attn_pool.cpp picks it where the CPU has AVX-512 (hm_attn_kernel).
extern "C" bool hm_attn_span_avx512(const HmAttnDecode& a, int b, int g0, int g1, const float* q, int64_t l0,
                                    int64_t l1, float* st, int64_t st_stride) __attribute__((weak));
