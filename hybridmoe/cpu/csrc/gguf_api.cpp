// C ABI of GGUF expert layers (--kt-method LLAMAFILE): a layer whose matrices are the GGUF file's
// own blocks (memory-mapped by Python, never copied), run by the same MoE driver (moe.cpp) and
// submitted with hm_submit like any layer. Compiled for baseline x86-64; the ISA is checked before
// a kernel table is chosen. An AMX request runs the AVX-512 kernels with an AMX tile path for large T
// (gguf_amx.cpp; the kernel name says which). Destroy with hm_gguf_layer_destroy, not hm_layer_destroy.
#include <cstdio>
#include <string>
#include <type_traits>

#include "gguf_common.h"
#include "moe.h"

extern "C" int hm_isa_check(int isa, char* msg, int len);
extern "C" int hm_amx_emulated();

namespace {

struct GgufLayer {
  hm::HmLayer base;  // first: the driver and hm_layer_kernel_name see an HmLayer
  HmGgufDesc g;
  hm::GgufPair p13, p2;
};
static_assert(std::is_standard_layout<hm::HmLayer>::value, "HmLayer must be standard layout");

std::string check_mat(const HmGgufMat& m, const char* name, int N, int K) {
  const std::string n(name);
  if (!m.data) return n + ": null data pointer";
  if (m.N != N || m.K != K)
    return n + ": shape [" + std::to_string(m.N) + ", " + std::to_string(m.K) + "] per expert, expected [" +
           std::to_string(N) + ", " + std::to_string(K) + "]";
  const int64_t rb = hm::gguf_row_bytes(m.type, K);
  if (rb < 0) return n + ": GGML type " + std::to_string(m.type) + " has no kernel or K is not a multiple of 256";
  if (m.row_bytes != rb) return n + ": row_bytes " + std::to_string(m.row_bytes) + " != " + std::to_string(rb);
  if (m.expert_stride < int64_t(N) * rb) return n + ": expert stride smaller than one expert";
  return "";
}

}  // namespace

extern "C" {

void* hm_gguf_layer_create(const HmGgufDesc* g, int isa, char* err, int errlen) {
  char why[512];
  std::string bad;
  if (!hm_isa_check(isa, why, sizeof(why))) bad = why;
  else if (g->E < 1 || g->H < 256 || g->I < 256 || g->H % 256 || g->I % 256)
    bad = "GGUF layers need H and I multiples of 256 (got H=" + std::to_string(g->H) + ", I=" + std::to_string(g->I) + ")";
  else if (g->act < hm::ACT_SILU || g->act > hm::ACT_SWIGLU_CLAMP) bad = "unknown activation";
  if (bad.empty()) bad = check_mat(g->gate, "gate", g->I, g->H);
  if (bad.empty()) bad = check_mat(g->up, "up", g->I, g->H);
  if (bad.empty()) bad = check_mat(g->down, "down", g->H, g->I);
  const hm::Kernels* k = nullptr;
  if (bad.empty()) {
    // the "amx" path (checked above: real tiles, or their software model under HYBRIDMOE_AMX_EMULATE=1)
    const hm::Kernels* (*amx)() = hm_amx_emulated() ? hm_kernels_gguf_amx_emu : hm_kernels_gguf_amx;
    if (isa == hm::ISA_AMX && amx) {
      k = amx();
    } else if (isa >= hm::ISA_AVX512 && hm_kernels_gguf_avx512 && hm_isa_check(hm::ISA_AVX512, nullptr, 0)) {
      k = hm_kernels_gguf_avx512();
      isa = hm::ISA_AVX512;
    } else if (hm_kernels_gguf_avx2) {
      k = hm_kernels_gguf_avx2();
      isa = hm::ISA_AVX2;
    } else {
      bad = "the library was built without the GGUF kernels";
    }
  }
  if (!bad.empty()) {
    if (err && errlen > 0) std::snprintf(err, size_t(errlen), "%s", bad.c_str());
    return nullptr;
  }
  auto* L = new GgufLayer();
  L->g = *g;
  L->p13 = hm::GgufPair{&L->g.gate, &L->g.up};
  L->p2 = hm::GgufPair{&L->g.down, nullptr};
  hm::LayerDesc& d = L->base.d;
  d.method = hm::M_GGUF;
  d.E = g->E;
  d.H = d.Hp = g->H;
  d.I = d.Ip = g->I;
  d.group = 64;
  d.act = g->act;
  d.act_alpha = g->act_alpha;
  d.act_limit = g->act_limit;
  d.w13 = hm::PackedMat{reinterpret_cast<const uint8_t*>(&L->p13), 0, nullptr, nullptr, nullptr, 2 * g->I, g->H};
  d.w2 = hm::PackedMat{reinterpret_cast<const uint8_t*>(&L->p2), 0, nullptr, nullptr, nullptr, g->H, g->I};
  L->base.k = k;
  L->base.isa = isa;
  L->base.k_fp32act = nullptr;
  return &L->base;
}

void hm_gguf_layer_destroy(void* l) { delete reinterpret_cast<GgufLayer*>(l); }

}  // extern "C"
