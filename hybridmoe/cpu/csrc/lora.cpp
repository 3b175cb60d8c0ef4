// Expert LoRA on the CPU experts (lora.h): the task-level driver pieces the MoE driver (moe.cpp)
// calls, and the C ABI that attaches a layer's slot weights. Compiled for baseline x86-64: the
// arithmetic is in the ISA units' kernels (lora_avx2.cpp, lora_avx512.cpp), chosen from the
// layer's checked ISA.
#include "lora.h"

#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"
#include "moe.h"

namespace hm {

struct LoraTask {
  const HmLoraDesc* d = nullptr;
  const LoraKernels* k = nullptr;
  const void* x = nullptr;
  int xdt = 0, H = 0;
  int64_t S = 0;
  const int32_t* slot_tok = nullptr;
  const float* af = nullptr;       // the activations, set by lora_mid
  std::vector<int32_t> sl, re;     // [S] adapter slot of each row (-1: none), expert of each row
  std::vector<float> a1, a2;       // [S][2R] sc A_g x | sc A_u x, [S][R] sc A_d h
  std::vector<int64_t> active;     // the rows with an adapter
  int nth = 1;

  int64_t esz() const { return d->wdtype == DT_F32 ? 4 : 2; }
  const uint8_t* blk(int slot, int e) const {
    return static_cast<const uint8_t*>(d->w) + (int64_t(slot) * d->E + e) * d->block * esz();
  }
  const void* part(int slot, int e, int64_t off) const { return blk(slot, e) + off * esz(); }
  // element offsets of the parts inside a block (lora.h)
  int64_t off_au() const { return int64_t(d->R) * d->Hp; }
  int64_t off_bg() const { return 2 * int64_t(d->R) * d->Hp; }
  int64_t off_bu() const { return off_bg() + int64_t(d->R) * d->Ip; }
  int64_t off_ad() const { return off_bg() + 2 * int64_t(d->R) * d->Ip; }
  int64_t off_bd() const { return off_bg() + 3 * int64_t(d->R) * d->Ip; }
};

namespace {

thread_local LoraTask g_task;  // tasks of a pool run one at a time on its leader thread

const LoraKernels* lora_kernels(int isa) {
  if (isa >= ISA_AVX512 && hm_lora_kernels_avx512) return hm_lora_kernels_avx512();
  return hm_lora_kernels_avx2 ? hm_lora_kernels_avx2() : nullptr;
}

inline void range_of(int64_t n, int tid, int nth, int64_t& b, int64_t& e) {
  b = n * tid / nth;
  e = n * (tid + 1) / nth;
}

// units: (active row, gate | up)
void ph_a1(int tid, void* p) {
  LoraTask& t = *static_cast<LoraTask*>(p);
  const HmLoraDesc& d = *t.d;
  int64_t b, e;
  range_of(int64_t(t.active.size()) * 2, tid, t.nth, b, e);
  const int64_t xes = t.xdt == DT_F32 ? 4 : 2;
  for (int64_t u = b; u < e; ++u) {
    const int64_t s = t.active[size_t(u / 2)];
    const int part = int(u % 2), slot = t.sl[size_t(s)];
    const void* xr = static_cast<const uint8_t*>(t.x) + int64_t(t.slot_tok[s]) * t.H * xes;
    t.k->dot(t.part(slot, t.re[size_t(s)], part ? t.off_au() : 0), d.wdtype, d.Hp, d.rank[slot], xr, t.xdt, t.H,
             d.scale[slot], t.a1.data() + s * 2 * d.R + part * d.R);
  }
}

void ph_a2(int tid, void* p) {
  LoraTask& t = *static_cast<LoraTask*>(p);
  const HmLoraDesc& d = *t.d;
  int64_t b, e;
  range_of(int64_t(t.active.size()), tid, t.nth, b, e);
  for (int64_t u = b; u < e; ++u) {
    const int64_t s = t.active[size_t(u)];
    const int slot = t.sl[size_t(s)];
    t.k->dot(t.part(slot, t.re[size_t(s)], t.off_ad()), d.wdtype, d.Ip, d.rank[slot], t.af + s * d.Ip, DT_F32, d.Ip,
             d.scale[slot], t.a2.data() + s * d.R);
  }
}

// A phase on all threads, or inline on the leader when it is smaller than a phase's wake-up
// and barrier cost (a few us: ~64K multiply-adds).
void run(ThreadPool& pool, LoraTask& t, ThreadPool::PhaseFn fn, int64_t macs) {
  if (macs <= (int64_t(1) << 16) || pool.size() == 1) {
    t.nth = 1;
    fn(0, &t);
  } else {
    t.nth = pool.size();
    pool.parallel(fn, &t);
  }
}

}  // namespace

const LoraTask* lora_begin(ThreadPool& pool, const HmLoraDesc& d, int isa, const int32_t* lora_idx, const void* x,
                           int x_dtype, int H, int64_t T, int64_t S, const int32_t* slot_tok, const int64_t* offs) {
  if (!d.w || !lora_idx || S <= 0) return nullptr;
  LoraTask& t = g_task;
  t.active.clear();
  t.sl.resize(size_t(S));
  t.re.resize(size_t(S));
  for (int e = 0; e < d.E; ++e)
    for (int64_t s = offs[e]; s < offs[e + 1]; ++s) t.re[size_t(s)] = e;
  int64_t rsum = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t tok = slot_tok[s];
    int32_t slot = lora_idx[tok];
    if (slot >= d.slots)
      throw std::runtime_error("LoRA slot " + std::to_string(slot) + " of token " + std::to_string(tok) +
                               " out of range [0, " + std::to_string(d.slots) + ")");
    if (slot >= 0 && (d.rank[slot] <= 0 || d.scale[slot] == 0.0f)) slot = -1;  // an empty slot: the base expert
    t.sl[size_t(s)] = slot;
    if (slot >= 0) {
      t.active.push_back(s);
      rsum += d.rank[slot];
    }
  }
  if (t.active.empty()) return nullptr;
  t.d = &d;
  t.k = lora_kernels(isa);
  if (!t.k) throw std::runtime_error("the library was built without the LoRA kernels");
  t.x = x;
  t.xdt = x_dtype;
  t.H = H;
  t.S = S;
  t.slot_tok = slot_tok;
  t.af = nullptr;
  t.a1.resize(size_t(S) * 2 * size_t(d.R));
  t.a2.resize(size_t(S) * size_t(d.R));
  (void)T;
  run(pool, t, ph_a1, rsum * 2 * H);
  return &t;
}

void lora_gate_up(const LoraTask& t, int e, int64_t r0, int M, int nb0, int nb1, float* C, int64_t ldc) {
  const HmLoraDesc& d = *t.d;
  for (int m = 0; m < M; ++m) {
    const int64_t s = r0 + m;
    const int slot = t.sl[size_t(s)];
    if (slot < 0) continue;
    const float* a = t.a1.data() + s * 2 * d.R;
    const int64_t j0 = int64_t(nb0 / 2) * 16;  // nb0 is even: its gate block
    const int npair = (nb1 - nb0) / 2;
    float* c = C + m * ldc;
    t.k->axpy(t.part(slot, e, t.off_bg() + j0), d.wdtype, d.Ip, d.rank[slot], a, npair, 16, c, 32);
    t.k->axpy(t.part(slot, e, t.off_bu() + j0), d.wdtype, d.Ip, d.rank[slot], a + d.R, npair, 16, c + 16, 32);
  }
}

void lora_mid(ThreadPool& pool, const LoraTask& tc, const float* af) {
  LoraTask& t = const_cast<LoraTask&>(tc);  // the state this thread owns (g_task)
  t.af = af;
  int64_t rsum = 0;
  for (int64_t s : t.active) rsum += t.d->rank[t.sl[size_t(s)]];
  run(pool, t, ph_a2, rsum * t.d->Ip);
}

void lora_down(const LoraTask& t, int e, int64_t r0, int M, int nb0, int nb1, float* y, int64_t ldy) {
  const HmLoraDesc& d = *t.d;
  for (int m = 0; m < M; ++m) {
    const int64_t s = r0 + m;
    const int slot = t.sl[size_t(s)];
    if (slot < 0) continue;
    t.k->axpy(t.part(slot, e, t.off_bd() + int64_t(nb0) * 16), d.wdtype, d.Hp, d.rank[slot], t.a2.data() + s * d.R,
              nb1 - nb0, 16, y + m * ldy, 16);
  }
}

}  // namespace hm

extern "C" {

// Attaches (desc->w non-null) or detaches (null) a layer's LoRA slot weights; the memory stays
// the caller's and must outlive the layer or the next attach. Call while no task of the layer is
// queued. Returns 0, or 1 with what is wrong in err.
int hm_layer_attach_lora(void* layer, const HmLoraDesc* desc, char* err, int errlen) {
  hm::HmLayer& L = *static_cast<hm::HmLayer*>(layer);
  const HmLoraDesc& d = *desc;
  std::string bad;
  if (!d.w) {
    L.lora = HmLoraDesc{};
    return 0;
  }
  if (!d.scale || !d.rank) bad = "null scale or rank pointer";
  else if (d.slots < 1 || d.R < 1 || d.R > 1024) bad = "slots must be >= 1 and the max rank in [1, 1024]";
  else if (d.E != L.d.E || d.Hp != L.d.Hp || d.Ip != L.d.Ip)
    bad = "LoRA slots for E=" + std::to_string(d.E) + ", Hp=" + std::to_string(d.Hp) + ", Ip=" + std::to_string(d.Ip) +
          " on a layer of E=" + std::to_string(L.d.E) + ", Hp=" + std::to_string(L.d.Hp) + ", Ip=" + std::to_string(L.d.Ip);
  else if (d.Hp % 16 || d.Ip % 16) bad = "padded sizes must be multiples of 16";
  else if (d.block != 3 * int64_t(d.R) * (d.Hp + d.Ip)) bad = "block must be 3 R (Hp + Ip)";
  else if (d.wdtype != hm::DT_F32 && d.wdtype != hm::DT_BF16) bad = "LoRA weights must be fp32 or bf16";
  else if (!hm_lora_kernels_avx2) bad = "the library was built without the LoRA kernels";
  if (!bad.empty()) {
    if (err && errlen > 0) std::snprintf(err, size_t(errlen), "%s", bad.c_str());
    return 1;
  }
  L.lora = d;
  return 0;
}

}  // extern "C"
