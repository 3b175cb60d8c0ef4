// Expert LoRA on the CPU experts (lora.h): the task-level driver pieces the MoE driver (moe.cpp)
// calls, and the C ABI that attaches a layer's slot weights. Compiled for baseline x86-64: the
// arithmetic is in the ISA units' kernels (lora_avx2.cpp, lora_avx512.cpp), chosen from the
// layer's checked ISA.
#include "lora.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
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
  mutable std::vector<float> a1, a2;  // [S][2R] sc A_g x | sc A_u x, [S][R] sc A_d h (written by the units)
  std::vector<int64_t> active;     // the rows with an adapter
  struct Group {
    int64_t s;  // first row
    int n;      // rows s .. s + n - 1: one expert, one slot, n <= LORA_ROWS
  };
  std::vector<Group> groups;       // the active rows in runs that share the weight loads
  struct Unit {
    int32_t g;       // group
    int16_t part;    // stage 1: 0 gate, 1 up; stage 2: 0
    int16_t k0;      // first rank (LORA_UNIT_RANKS of them at most)
  };
  std::vector<Unit> units[2];      // the rank-product units of stage 1 (x) and stage 2 (h)
  // per expert, the units of each stage not yet done: a GEMM item of that expert waits for 0
  std::unique_ptr<std::atomic<int32_t>[]> pending[2];
  int pending_cap = 0;

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

// Rows m0.. of an item (one expert) with an adapter, in runs of one slot of at most LORA_ROWS rows:
// fn(m, n, slot) per run.
template <class F>
inline void for_runs(const LoraTask& t, int64_t r0, int M, F fn) {
  for (int m = 0; m < M;) {
    const int slot = t.sl[size_t(r0 + m)];
    if (slot < 0) {
      ++m;
      continue;
    }
    int n = 1;
    while (n < LORA_ROWS && m + n < M && t.sl[size_t(r0 + m + n)] == slot) ++n;
    fn(m, n, slot);
    m += n;
  }
}

// A GEMM item of expert e adds its B terms once every rank-product unit of e in this stage is done
// (they sit ahead of every GEMM item in the queues, and a unit waits for nothing: no deadlock).
inline void wait_units(const LoraTask& t, int stage, int e) {
  const std::atomic<int32_t>& p = t.pending[stage][e];
  while (p.load(std::memory_order_acquire) > 0) _mm_pause();
}

}  // namespace

void lora_warm(const HmLoraDesc& d, const int32_t* lora_idx, int64_t T) {
  // Between two tasks of a layer the experts' weights stream through the caches, so the state
  // lora_begin reads (a few dozen lines) is cold: a memory latency each, in series on the leader
  // while the other threads wait. Requested here, before routing, they arrive meanwhile. Only the
  // head of each buffer (what a decode-sized task touches): the vectors keep the capacity of the
  // largest task seen, and a prefill-sized task's state is not worth a prefetch per line.
  static constexpr int64_t kHead = 512;
  auto lines = [](const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (int64_t o = 0; p && o < std::min(bytes, kHead); o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
  };
  const LoraTask& t = g_task;
  lines(lora_idx, T * 4);
  lines(d.rank, int64_t(d.slots) * 4);
  lines(d.scale, int64_t(d.slots) * 4);
  lines(t.sl.data(), int64_t(t.sl.size()) * 4);
  lines(t.re.data(), int64_t(t.re.size()) * 4);
  lines(t.active.data(), int64_t(t.active.capacity()) * 8);
  lines(t.groups.data(), int64_t(t.groups.capacity()) * int64_t(sizeof(LoraTask::Group)));
  for (int st = 0; st < 2; ++st) {
    lines(t.units[st].data(), int64_t(t.units[st].capacity()) * int64_t(sizeof(LoraTask::Unit)));
    // every expert's counter is reset by lora_begin: all of them (E int32s, 1 KB at E = 256)
    if (t.pending_cap)
      for (int64_t o = 0; o < int64_t(std::min(t.pending_cap, d.E)) * 4; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(t.pending[st].get()) + o, _MM_HINT_T0);
  }
}

const LoraTask* lora_begin(const HmLoraDesc& d, int isa, const int32_t* lora_idx, const void* x, int x_dtype, int H,
                           int64_t T, int64_t S, const int32_t* slot_tok, const int64_t* offs) {
  if (!d.w || !lora_idx || S <= 0) return nullptr;
  LoraTask& t = g_task;
  t.active.clear();
  t.groups.clear();
  t.sl.resize(size_t(S));
  t.re.resize(size_t(S));
  for (int e = 0; e < d.E; ++e)
    for (int64_t s = offs[e]; s < offs[e + 1]; ++s) t.re[size_t(s)] = e;
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
      LoraTask::Group* g = t.groups.empty() ? nullptr : &t.groups.back();
      if (g && g->s + g->n == s && g->n < LORA_ROWS && t.sl[size_t(g->s)] == slot && t.re[size_t(g->s)] == t.re[size_t(s)])
        ++g->n;
      else
        t.groups.push_back({s, 1});
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
  if (t.pending_cap < d.E) {
    for (auto& p : t.pending) p.reset(new std::atomic<int32_t>[size_t(d.E)]);
    t.pending_cap = d.E;
  }
  for (int st = 0; st < 2; ++st) {
    t.units[st].clear();
    for (int e = 0; e < d.E; ++e) t.pending[st][e].store(0, std::memory_order_relaxed);
  }
  for (size_t gi = 0; gi < t.groups.size(); ++gi) {
    const LoraTask::Group g = t.groups[gi];
    const int r = d.rank[t.sl[size_t(g.s)]], e = t.re[size_t(g.s)];
    for (int k0 = 0; k0 < r; k0 += LORA_UNIT_RANKS) {
      t.units[0].push_back({int32_t(gi), 0, int16_t(k0)});
      t.units[0].push_back({int32_t(gi), 1, int16_t(k0)});
      t.units[1].push_back({int32_t(gi), 0, int16_t(k0)});
      // plain read-modify-writes (no locked add): only this thread touches the counters until the
      // GEMM phase starts, which publishes them to the pool's threads
      t.pending[0][e].store(t.pending[0][e].load(std::memory_order_relaxed) + 2, std::memory_order_relaxed);
      t.pending[1][e].store(t.pending[1][e].load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    }
  }
  return &t;
}

int64_t lora_units(const LoraTask& t, int stage) { return int64_t(t.units[stage].size()); }

void lora_unit(const LoraTask& t, int stage, int64_t u) {
  const HmLoraDesc& d = *t.d;
  const LoraTask::Unit un = t.units[stage][size_t(u)];
  const LoraTask::Group g = t.groups[size_t(un.g)];
  const int slot = t.sl[size_t(g.s)], e = t.re[size_t(g.s)];
  const int rows = std::min(LORA_UNIT_RANKS, d.rank[slot] - un.k0);
  const void* vs[LORA_ROWS];
  if (stage == 0) {  // sc A_{g|u} x of the group's rows, ranks k0 ..
    const int64_t xes = t.xdt == DT_F32 ? 4 : 2;
    for (int m = 0; m < g.n; ++m) vs[m] = static_cast<const uint8_t*>(t.x) + int64_t(t.slot_tok[g.s + m]) * t.H * xes;
    t.k->dot(t.part(slot, e, (un.part ? t.off_au() : 0) + int64_t(un.k0) * d.Hp), d.wdtype, d.Hp, rows, vs, t.xdt,
             g.n, t.H, d.scale[slot], t.a1.data() + g.s * 2 * d.R + un.part * d.R + un.k0, 2 * d.R);
  } else {  // sc A_d h
    for (int m = 0; m < g.n; ++m) vs[m] = t.af + (g.s + m) * d.Ip;
    t.k->dot(t.part(slot, e, t.off_ad() + int64_t(un.k0) * d.Ip), d.wdtype, d.Ip, rows, vs, DT_F32, g.n, d.Ip,
             d.scale[slot], t.a2.data() + g.s * d.R + un.k0, d.R);
  }
  t.pending[stage][e].fetch_sub(1, std::memory_order_release);
}

void lora_gate_up(const LoraTask& t, int e, int64_t r0, int M, int nb0, int nb1, float* C, int64_t ldc) {
  const HmLoraDesc& d = *t.d;
  const int64_t bs = int64_t(d.R) * 16;  // elements of one 16-column block of a B (lora.h)
  const int64_t p0 = nb0 / 2;            // nb0 is even: the gate block of the first (gate, up) pair
  const int npair = (nb1 - nb0) / 2;
  bool waited = false;
  for_runs(t, r0, M, [&](int m, int n, int slot) {
    if (!waited) {
      wait_units(t, 0, e);
      waited = true;
    }
    const float* a = t.a1.data() + (r0 + m) * 2 * d.R;
    float* c = C + m * ldc;
    t.k->axpy(t.part(slot, e, t.off_bg() + p0 * bs), d.wdtype, 16, d.rank[slot], a, 2 * d.R, n, npair, bs, c, ldc, 32);
    t.k->axpy(t.part(slot, e, t.off_bu() + p0 * bs), d.wdtype, 16, d.rank[slot], a + d.R, 2 * d.R, n, npair, bs,
              c + 16, ldc, 32);
  });
}

void lora_prefetch(const LoraTask& t, int stage, int e, int64_t r0, int M, int nb0, int nb1) {
  const HmLoraDesc& d = *t.d;
  const int64_t bs = int64_t(d.R) * 16, es = t.esz();
  int last = -1;
  for_runs(t, r0, M, [&](int, int, int slot) {
    if (slot == last) return;  // a prefill item's rows share a few slots: their lines once
    last = slot;
    const int64_t len = (stage == 0 ? (nb1 - nb0) / 2 : nb1 - nb0) * bs * es;  // bytes of each B's item range
    const int64_t off0 = stage == 0 ? t.off_bg() + nb0 / 2 * bs : t.off_bd() + int64_t(nb0) * bs;
    for (int part = 0; part < (stage == 0 ? 2 : 1); ++part) {
      const char* p = static_cast<const char*>(t.part(slot, e, off0 + part * (t.off_bu() - t.off_bg())));
      for (int64_t b = 0; b < len; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
    }
  });
}

void lora_mid(const LoraTask& tc, const float* af) {
  const_cast<LoraTask&>(tc).af = af;  // the state this thread owns (g_task); read by the stage-2 units
}

void lora_down(const LoraTask& t, int e, int64_t r0, int M, int nb0, int nb1, float* y, int64_t ldy) {
  const HmLoraDesc& d = *t.d;
  const int64_t bs = int64_t(d.R) * 16;
  bool waited = false;
  for_runs(t, r0, M, [&](int m, int n, int slot) {
    if (!waited) {
      wait_units(t, 1, e);
      waited = true;
    }
    t.k->axpy(t.part(slot, e, t.off_bd() + int64_t(nb0) * bs), d.wdtype, 16, d.rank[slot],
              t.a2.data() + (r0 + m) * d.R, d.R, n, nb1 - nb0, bs, y + m * ldy, ldy, 16);
  });
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
