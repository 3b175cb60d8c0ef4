// hm_attn_decode / hm_attn_decode_pool: one decode attention step (attn_decode.h) on this thread or
// spread over a pool's threads. Compiled for baseline x86-64: the ISA is checked before a kernel runs.
//
// Work units are (sequence b, kv head g): each normalizes and rotates its G query heads and its new k,
// and stores the new k/v. When the positions to read are few against the threads, each unit also
// attends over its sequence's positions for its kv head and writes its output (one phase). Else each
// sequence's positions are cut into spans, each attending every kv head over its positions (reading
// each position's row of all heads once, in order: one kv head a unit read 2D bytes of every Hkv * 2D,
// 2x slower from DRAM at Hkv 4 on the 2-core Zen 4), merged by their softmax states (flash-decoding):
// three phases, prep, spans, merge.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <vector>

#include "attn_decode.h"
#include "common.h"
#include "pool.h"

extern "C" int hm_isa_check(int isa, char* msg, int len);

namespace {

constexpr int64_t kMinSpan = 64;  // positions (of every kv head): shorter spans cost more in merging than they share out

struct Unit {
  int b;
  int64_t l0, l1;
  int st;  // index of its first state (one a kv head)
};

// Which span kernel runs (hm_attn_kernel): 0 the best the CPU has, 1 AVX2, 2 AVX-512.
std::atomic<int> g_kernel{0};

struct Run {
  const HmAttnDecode* a;
  const hm::AttnDecodeKernels* k;
  bool avx512 = false;            // the AVX-512 span (hm_attn_span_avx512) where it takes this G
  int G;
  int64_t st_stride;
  std::vector<Unit> spans;        // every span (sequences with one span: l0 = 0, l1 = L)
  std::vector<int> first;         // per b: index of its first span; first[b + 1] - first[b] spans
  std::vector<float> q, st;       // [B][Hq][D] prepared queries, span states [span][Hkv]
  bool fused = true;              // one span per sequence: prep, span and finish of each (b, g) in one unit
  std::atomic<int64_t> next{0};
};

thread_local std::vector<float> tl_scores;

float* scores_for(int64_t n) {
  if (int64_t(tl_scores.size()) < n) tl_scores.resize(size_t(n));
  return tl_scores.data();
}

float* q_of(Run& r, int b, int g) { return r.q.data() + (int64_t(b) * r.a->Hq + int64_t(g) * r.G) * r.a->D; }

void do_prep(Run& r, int u) {
  const int b = u / r.a->Hkv, g = u % r.a->Hkv;
  r.k->prep(*r.a, b, g, q_of(r, b, g));
}
// one span: the AVX-512 kernel where chosen and it takes this G, else the AVX2 one
void span_of(Run& r, int b, int g0, int g1, const float* q, int64_t l0, int64_t l1, float* st, int64_t sc_n) {
  if (r.avx512 && hm_attn_span_avx512(*r.a, b, g0, g1, q, l0, l1, st, r.st_stride)) return;
  r.k->span(*r.a, b, g0, g1, q, l0, l1, st, r.st_stride, scores_for(sc_n));
}

void do_span(Run& r, int i) {
  const Unit& s = r.spans[size_t(i)];
  span_of(r, s.b, 0, r.a->Hkv, q_of(r, s.b, 0), s.l0, s.l1, r.st.data() + s.st * r.st_stride,
          hm::span_scratch(r.G, s.l1 - s.l0));
}
void do_finish(Run& r, int u) {
  const int Hkv = r.a->Hkv, b = u / Hkv, g = u % Hkv;
  const int f = r.first[size_t(b)], n = r.first[size_t(b) + 1] - f;
  r.k->finish(*r.a, b, g, r.st.data() + (int64_t(f) * Hkv + g) * r.st_stride, n, Hkv * r.st_stride);
}
void do_unit(Run& r, int u) {  // every sequence in one span: unit (b, g) alone
  const int b = u / r.a->Hkv, g = u % r.a->Hkv;
  do_prep(r, u);
  float* st = r.st.data() + int64_t(u) * r.st_stride;
  span_of(r, b, g, g + 1, q_of(r, b, g), 0, r.a->seq_lens[b], st, hm::span_scratch(r.G, r.a->seq_lens[b]));
  r.k->finish(*r.a, b, g, st, 1, r.st_stride);
}

template <void (*F)(Run&, int)>
void phase(int, void* p) {
  Run& r = *static_cast<Run*>(p);
  const int64_t n = F == do_span ? int64_t(r.spans.size()) : (int64_t(r.first.size()) - 1) * r.a->Hkv;
  for (int64_t i; (i = r.next.fetch_add(1, std::memory_order_relaxed)) < n;) F(r, int(i));
}

void run_all(hm::ThreadPool* tp, Run& r) {
  auto go = [&](hm::ThreadPool::PhaseFn fn) {
    r.next.store(0, std::memory_order_relaxed);
    if (tp) tp->parallel(fn, &r, true);  // units from a counter: a dynamic phase
    else fn(0, &r);
  };
  if (r.fused) {
    go(phase<do_unit>);
    return;
  }
  go(phase<do_prep>);
  go(phase<do_span>);
  go(phase<do_finish>);
}

bool avx512_ok() {
  static const bool ok = hm_attn_span_avx512 && hm_isa_check(hm::ISA_AVX512, nullptr, 0);
  return ok;
}

bool use_avx512() {
  const int k = g_kernel.load(std::memory_order_relaxed);
  return k != 1 && avx512_ok();
}

}  // namespace

extern "C" {

// The span kernel of every later decode attention call in this process: 0 the best the CPU has (AVX-512
// where it has F, BW, VL, VNNI and BF16, else AVX2), 1 AVX2, 2 AVX-512; -1 only asks. Returns the setting
// before, or -2 (nothing changed) for an unknown value or AVX-512 asked where it cannot run.
int hm_attn_kernel(int kernel) {
  if (kernel == -1) return g_kernel.load();
  if (kernel < 0 || kernel > 2 || (kernel == 2 && !avx512_ok())) return -2;
  return g_kernel.exchange(kernel);
}

// One decode attention step; pool: a pool handle (its threads share the work when it is idle; busy,
// or nullptr: all on this thread). Returns 0, or 1 with what is wrong in err.
int hm_attn_decode_pool(void* pool, const HmAttnDecode* a, char* err, int errlen) {
  const char* bad = "";
  if (!hm_isa_check(hm::ISA_AVX2, nullptr, 0) || !hm_attn_decode_kernels_avx2) bad = "needs AVX2 (or was not built)";
  else if (!a || a->B < 0 || a->Hkv < 1 || a->Hq < 1 || a->Hq % a->Hkv || a->D < 2 || a->D % 2 || a->D > 1024 ||
           a->S < 1)
    bad = "bad sizes";
  else if (a->B > 0 && (!a->qkv || !a->cos || !a->sin || !a->positions || !a->k_cache || !a->v_cache || !a->slots ||
                        !a->block_table || !a->seq_lens || !a->out))
    bad = "null pointer";
  else
    for (int b = 0; b < a->B; ++b)
      if (a->seq_lens[b] < 1) bad = "a sequence length below 1";
  if (*bad) {
    if (err && errlen > 0) std::snprintf(err, size_t(errlen), "hm_attn_decode: %s", bad);
    return 1;
  }
  if (a->B == 0) return 0;
  hm::Pool* p = static_cast<hm::Pool*>(pool);
  const int nth = p ? p->tp.size() : 1;
  Run r;
  r.a = a;
  r.k = hm_attn_decode_kernels_avx2();
  r.avx512 = use_avx512();
  r.G = a->Hq / a->Hkv;
  r.st_stride = int64_t(r.G) * (2 + a->D);
  int64_t work = 0;  // positions to read, summed over the sequences
  for (int b = 0; b < a->B; ++b) work += a->seq_lens[b];
  // ~2 spans a thread (a late thread leaves its share to the others), each >= kMinSpan positions
  const int64_t span = nth == 1 ? INT64_MAX : std::max(kMinSpan, (work + 2 * nth - 1) / (2 * nth));
  r.first.reserve(size_t(a->B) + 1);
  for (int b = 0; b < a->B; ++b) {
    r.first.push_back(int(r.spans.size()));
    const int64_t L = a->seq_lens[b];
    for (int64_t l0 = 0; l0 < L; l0 += span) {
      const int64_t l1 = L - l0 <= span ? L : l0 + span;
      r.spans.push_back({b, l0, l1, int(r.spans.size()) * a->Hkv});
      if (l1 == L) break;
    }
    if (r.spans.size() - size_t(r.first.back()) > 1) r.fused = false;
  }
  r.first.push_back(int(r.spans.size()));
  r.q.resize(size_t(a->B) * a->Hq * a->D);
  r.st.resize(r.spans.size() * size_t(a->Hkv) * size_t(r.st_stride));
  struct Lead {
    hm::ThreadPool* tp;
    Run* r;
  } lead{p ? &p->tp : nullptr, &r};
  // with one unit, or the pool busy (run_inline false): all of it on this thread
  if (p && nth > 1 && (r.spans.size() > 1 || a->B * a->Hkv > 1) &&
      p->tp.run_inline([](void* l) { run_all(static_cast<Lead*>(l)->tp, *static_cast<Lead*>(l)->r); }, &lead))
    return 0;
  run_all(nullptr, r);
  return 0;
}

// The same on this thread alone.
int hm_attn_decode(const HmAttnDecode* a, char* err, int errlen) { return hm_attn_decode_pool(nullptr, a, err, errlen); }

}  // extern "C"
