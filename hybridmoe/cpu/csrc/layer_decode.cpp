// hm_layer_decode (layer_decode.h): the calls of one decoder layer's attention half, in order.
// Compiled for baseline x86-64: every callee checks the ISA itself.
#include "layer_decode.h"

#include <chrono>
#include <cstdio>

extern "C" int hm_dense(void* p, const HmDenseTask* t, int isa, int64_t spin_us, char* err, int errlen);
extern "C" int hm_attn_decode_pool(void* pool, const HmAttnDecode* a, char* err, int errlen);
extern "C" int hm_add_rmsnorm_bf16(const uint16_t* x, const uint16_t* res, const uint16_t* w, int64_t rows, int64_t H,
                                   float eps, uint16_t* out, uint16_t* res_out);
extern "C" int hm_topk_softmax(const void* logits, int32_t dtype, int64_t T, int64_t E, int64_t ld, int32_t K,
                               int32_t renorm, float* w, int32_t* ids);
extern "C" int hm_run_task(void* p, const HmTask* task, int64_t spin_us, char* err, int errlen);

namespace {
// Wall seconds in each part of the layer calls since the last reset (hm_layer_profile): the norms,
// qkv GEMV, attention, o_proj GEMV, router GEMV, routing, the MoE task, and the call count. Unlike the
// pool's task phases these parts are not memory-bound work alone: each includes its phase's start and
// barrier on the pool, which is what bench_cpu_decode --split compares against the bytes.
enum { P_NORMS, P_QKV, P_ATTN, P_O, P_ROUTER, P_ROUTE, P_MOE, P_CALLS, P_N };
double g_layer_profile[P_N] = {0};
struct Lap {
  std::chrono::steady_clock::time_point t = std::chrono::steady_clock::now();
  void operator()(int i) {
    const auto n = std::chrono::steady_clock::now();
    g_layer_profile[i] += std::chrono::duration<double>(n - t).count();
    t = n;
  }
};
}  // namespace

extern "C" {

// Copies the layer calls' part times (seconds: norms, qkv, attention, o_proj, router, routing, MoE task)
// and their count into out8, then zeroes them when reset.
void hm_layer_profile(double* out8, int reset) {
  for (int i = 0; i < P_N; ++i) {
    out8[i] = g_layer_profile[i];
    if (reset) g_layer_profile[i] = 0;
  }
}

// Runs the layer's attention half on `pool` (dense GEMVs led by this thread when the pool is idle),
// then (d->moe.layer) its MoE block.
// Returns 0, or 1 with what failed in err.
int hm_layer_decode(void* pool, const HmLayerDecode* d, char* err, int errlen) {
  auto fail = [&](const char* what) {
    if (err && errlen > 0 && !*err) std::snprintf(err, size_t(errlen), "hm_layer_decode: %s failed", what);
    return 1;
  };
  if (err && errlen > 0) err[0] = 0;
  Lap lap;
  if (d->norm1_w && hm_add_rmsnorm_bf16(d->x, d->res_in, d->norm1_w, d->T, d->H, d->eps1, d->h1, d->res1))
    return fail("input norm");
  lap(P_NORMS);
  if (hm_dense(pool, &d->qkv, d->isa, 0, err, errlen)) return fail("qkv_proj");
  lap(P_QKV);
  if (hm_attn_decode_pool(pool, &d->attn, err, errlen)) return fail("attention");
  lap(P_ATTN);
  if (hm_dense(pool, &d->o, d->isa, 0, err, errlen)) return fail("o_proj");
  lap(P_O);
  if (hm_add_rmsnorm_bf16(static_cast<const uint16_t*>(d->o.out), d->res2_in, d->norm2_w, d->T, d->H, d->eps2, d->h2,
                          d->res2))
    return fail("post-attention norm");
  lap(P_NORMS);
  if (d->router.N > 0 && hm_dense(pool, &d->router, d->isa, 0, err, errlen)) return fail("router");
  lap(P_ROUTER);
  g_layer_profile[P_CALLS] += 1;
  if (d->moe.layer) {
    HmTask t = d->moe;  // (d is const here: the routing writes the buffers t.ids / t.weights point at)
    if (d->router.N <= 0 || d->router.out_dtype != 1 || t.ids_dtype != 0 || t.T != d->T)
      return fail("MoE set-up (needs the router GEMV's bf16 logits, int32 ids and T rows)");
    if (hm_topk_softmax(d->router.out, 1, d->T, d->router.N, d->router.ldo, t.K, d->moe_renorm,
                        const_cast<float*>(t.weights), static_cast<int32_t*>(const_cast<void*>(t.ids))))
      return fail("routing");
    if (d->moe_counts)  // ids are in [0, E): the routing wrote them
      for (int64_t i = 0; i < d->T * t.K; ++i) d->moe_counts[static_cast<const int32_t*>(t.ids)[i]] += 1;
    lap(P_ROUTE);
    // as CPUMoELayer.run: inline on this thread when the pool is idle (AMX layers: on the pool's threads)
    if (hm_run_task(pool, &t, -1, err, errlen)) return fail("MoE task");
    lap(P_MOE);
  }
  return 0;
}

// The n layers of s in order (HmDecodeStack), then the final norm; 0, or 1 with what failed in err
// (naming the layer).
int hm_layers_decode(void* pool, const HmLayerDecode* const* layers, const HmDecodeStack* s, char* err, int errlen) {
  if (err && errlen > 0) err[0] = 0;
  if (!s || !layers || s->n < 1 || s->T < 1 || s->H < 1) {
    if (err && errlen > 0) std::snprintf(err, size_t(errlen), "hm_layers_decode: no layers or rows");
    return 1;
  }
  for (int32_t i = 0; i < s->n; ++i)  // before anything is written: the buffers are sized for them
    if (!layers[i] || layers[i]->T != s->T || layers[i]->H != s->H) {
      if (err && errlen > 0)
        std::snprintf(err, size_t(errlen), "hm_layers_decode: layer %d was set up for other sizes", int(i));
      return 1;
    }
  if (hm_add_rmsnorm_bf16(s->x, nullptr, s->norm0_w, s->T, s->H, s->eps0, s->h0, nullptr)) {
    if (err && errlen > 0) std::snprintf(err, size_t(errlen), "hm_layers_decode: layer 0's input norm failed");
    return 1;
  }
  for (int32_t i = 0; i < s->n; ++i) {
    HmLayerDecode d = *layers[i];  // (small: the step's metadata patched into a copy)
    d.attn.positions = s->positions;
    d.attn.slots = s->slots;
    d.attn.block_table = s->block_table;
    d.attn.ld_bt = s->ld_bt;
    d.attn.seq_lens = s->seq_lens;
    if (i == 0) d.res2_in = s->x;
    if (hm_layer_decode(pool, &d, err, errlen)) {
      if (err && errlen > 0) {  // the layer's message, prefixed with its index
        char inner[512];
        std::snprintf(inner, sizeof(inner), "%s", err);
        std::snprintf(err, size_t(errlen), "layer %d: %s", i, inner);
      }
      return 1;
    }
  }
  const HmLayerDecode& last = *layers[s->n - 1];
  if (hm_add_rmsnorm_bf16(static_cast<const uint16_t*>(last.moe.out), last.res2, s->normf_w, s->T, s->H, s->epsf,
                          s->out, s->res_f)) {
    if (err && errlen > 0) std::snprintf(err, size_t(errlen), "hm_layers_decode: the final norm failed");
    return 1;
  }
  return 0;
}

}  // extern "C"
