// The MoE layer driver (see moe.h). Phases, each spread over all pool threads:
//   1 quantize x per slot  2 w13 GEMM + activation  3 quantize the activation
//   4 w2 GEMM into y[slot]  5 out[t] (+)= sum_j w_j * y[slot(t, j)]
// Decode-sized tasks fold phase 3 into phase 2 (each expert's rows converted by the thread that finishes
// its last gate/up item) and, at one token, phase 5 into phase 4 (moe.h kFuse*).
// Kernels with quant_block (GGUF) fold phase 3 into phase 2: each 256-column block of an expert's
// activation rows is converted by the thread that finishes the last gate/up item of that block.
// Rows of an expert routed one token only are not gathered in phase 1: its items read the token's
// row of x quantized (XQ) in place.
// GEMM work is cut into items (expert, N-block range, row range) taken dynamically by the threads
// of the sub-pool that owns the N-block range, so small T spreads each expert's rows over all
// threads (weights streamed once) and large T gets cache-sized tiles.
#include "moe.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <initializer_list>
#include <tuple>
#include <vector>

namespace hm {

namespace {

constexpr int MC = 256;       // rows per GEMM item
constexpr int CW1 = 2;        // N-blocks per w13 item (one gate/up pair) for few rows (decode), at least
constexpr int CW2 = 4;        // N-blocks per w2 item for few rows, at least
constexpr int CW_FEW = 32;    // N-blocks per few-row item, at most (few_row_cw)
constexpr int64_t kFewItemBytes = 1 << 20;  // weight bytes per few-row item, at most
constexpr int CW_BIG = 8;     // N-blocks per item when an expert has >= BIG_ROWS rows: the rows'
constexpr int BIG_ROWS = 64;  //   activations are then reused across 8 blocks from L2
constexpr int HCHUNK = 256;   // output columns per reduction unit
constexpr int PADROWS = 32;   // extra activation rows (AMX tiles read up to 32 rows past an expert)
constexpr int MAXSUB = 64;
constexpr int QBLK = 256;               // columns per quant_block call
constexpr int QNB = 2 * QBLK / 16;      // w13 N-blocks (gate + up) that produce one block
static_assert(QNB % CW1 == 0 && QNB % CW_BIG == 0 && QNB % CW_FEW == 0, "a w13 item must not straddle a quant block");
static_assert(CW_FEW * (BIG_ROWS - 1) <= MC * CW_BIG, "a few-row w13 item's outputs must fit the per-thread C buffer");

// This unit is compiled for baseline x86-64 (so template instances it emits are safe everywhere);
// only the functions marked HM_AVX2 use AVX2/FMA/F16C, and they run after the CPU check.
#define HM_AVX2 __attribute__((target("avx2,fma,f16c")))

struct Buf {
  uint8_t* p = nullptr;
  size_t cap = 0;
  ~Buf() { std::free(p); }
  template <class T>
  T* get(size_t count) {
    size_t n = count * sizeof(T);
    if (n > cap) {
      std::free(p);
      p = nullptr;
      cap = 0;
      size_t c = size_t(round_up(int64_t(n + n / 4 + 64), 4096));
      p = static_cast<uint8_t*>(std::aligned_alloc(64, c));
      if (!p) throw std::bad_alloc();
      std::memset(p, 0, c);
      cap = c;
    }
    return reinterpret_cast<T*>(p);
  }
};

struct Item {
  int e, nb0, nb1, m0, m1;
  int stage = 0;  // 0: w13, 1: w2 (a chained phase holds both, ph_gemm<2>)
};

struct alignas(64) Counter {
  std::atomic<int64_t> v{0};
};

HM_AVX2 inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

// o[0..16) = act(g) * u
HM_AVX2 void act16(const LayerDesc& d, const float* g, const float* u, float* o) {
  if (d.act == ACT_SILU) {
    for (int h = 0; h < 16; h += 8) {
      __m256 G = _mm256_loadu_ps(g + h), U = _mm256_loadu_ps(u + h);
      __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), G)));
      _mm256_storeu_ps(o + h, _mm256_div_ps(_mm256_mul_ps(G, U), den));
    }
  } else if (d.act == ACT_GELU_TANH) {
    for (int h = 0; h < 16; ++h) {
      float x = g[h];
      o[h] = 0.5f * x * (1.0f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x))) * u[h];
    }
  } else {  // clamped SwiGLU (gpt-oss): min(g, L) * sigmoid(alpha * .) * (clamp(u, -L, L) + 1)
    for (int h = 0; h < 16; ++h) {
      float x = std::min(g[h], d.act_limit), v = std::max(std::min(u[h], d.act_limit), -d.act_limit);
      o[h] = x / (1.0f + std::exp(-d.act_alpha * x)) * (v + 1.0f);
    }
  }
}

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// 8 floats -> 8 bf16, round to nearest even
HM_AVX2 inline __m128i f32_to_bf16_8(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  u = _mm256_srli_epi32(u, 16);
  __m128i lo = _mm256_castsi256_si128(u), hi = _mm256_extracti128_si256(u, 1);
  return _mm_packus_epi32(lo, hi);
}

}  // namespace

struct Workspace {
  Buf a1, a2, sx1, sx2, g1, g2, af, y, slot_tok, slot_w, tok_slot, xq, xs, xg, gsl, badrow;
  std::vector<Buf> cbuf;
  std::vector<int64_t> count, offs, pos, qbase;
  std::vector<uint8_t> egroup;  // [E] bit g set: the expert has rows of pair group g (HmTask.ids2)
  std::unique_ptr<std::atomic<int>[]> qdone;  // [units] w13 N-blocks done per (expert, row chunk, block)
  int64_t qcap = 0;
  std::unique_ptr<Counter[]> rdone;  // [chunks] w2 N-blocks done per HCHUNK output chunk (fuse_red), a line each
  int64_t rcap = 0;
  std::unique_ptr<Counter[]> edone;  // [E] per expert: w13 N-blocks done (fuse_q2row) / blocks converted (chain)
  int64_t ecap = 0;
  std::vector<Item> items;
  std::vector<std::vector<Item>> per_sub;
  explicit Workspace(int n) : cbuf(size_t(n)) {}
};

Workspace* workspace_create(int nthreads) { return new Workspace(nthreads); }
void workspace_destroy(Workspace* w) { delete w; }

namespace {

struct Ctx {
  const HmTask* t;
  const LayerDesc* d;
  const Kernels* k;
  ThreadPool* pool;
  Workspace* ws;
  int prefetch = 0;  // software prefetch distance of the few-row kernels (bytes)
  int block_prefetch = 0;  // ActView::block_prefetch
  int items_per_thread = kFewItemsPerThread;  // TaskOpts::items_per_thread
  std::atomic<bool>* done1_set = nullptr;  // TaskOpts::done1_set
  int nth = 1;  // threads sharing the current light phase (1: run inline by the leader)
  std::atomic<int64_t> light_next{0};  // the next piece of a parallel light phase (Pieces)
  bool round_act_bf16 = false;  // BF16 on the fp32-activation kernel with bf16 x: round like the others
  int64_t S, ld1, ld2;
  int gs1, gs2, xes;
  uint8_t *A1, *A2, *XQ;  // XQ: x quantized once per token
  float* XS;
  int32_t* XG;
  float *sx1, *sx2, *af, *y;
  int32_t *g1, *g2, *slot_tok, *tok_slot;
  int32_t* gsl;     // the slots phase 1 gathers (those of experts with 2 or more rows)
  int64_t ngsl = 0;
  float* slot_w;
  bool fuse_q2 = false;  // the activation is converted inside the w13 phase (Kernels::quant_block)
  bool fuse_red = false;  // one token: the weighted sum is done inside the w2 phase (reduce_done)
  bool fuse_q2row = false;  // few rows an expert: its activation rows are converted inside the w13 phase
  bool chain = false;  // w2 items in the w13 phase, each after its expert's rows are converted (ph_gemm<2>)
  int ngroups = 1;  // pair groups (2: HmTask.ids2 given, its own output out2)
  int64_t TK = 0;   // T * K: the pairs of one group (tok_slot holds ngroups * TK)
  int64_t Sg[2] = {0, 0};  // slots of each group
  int64_t nrc = 0;  // rdone counters per group (fuse_red)
  std::atomic<int64_t> red0{0};  // group 0's output chunks reduced (fuse_red): all of them -> done1
  std::atomic<bool> g0_done{false};  // finish_group0 ran
  int64_t ready_at = 0;  // chain: edone[e] at this value = expert e's rows converted
  const LoraTask* lora = nullptr;  // the pairs' adapter deltas (lora.h); null: none in this task
  int64_t sub_beg[MAXSUB + 1];
  Counter next[MAXSUB];
  std::atomic<int> bad{0};
  std::atomic<int64_t> bad_tok{-1};  // a token whose row was found non-finite (-1: none known)
  uint8_t* badrow = nullptr;  // HmTask.nan_rows: [T] tokens whose output row is written NaN (else null)
  std::atomic<int> any_badrow{0};
  void mark_bad(int64_t tok) {  // the error names it: the engine fails that token's request alone
    if (badrow) {  // or its output row is NaN and the task goes on
      __atomic_store_n(&badrow[tok], uint8_t(1), __ATOMIC_RELAXED);
      any_badrow.store(1, std::memory_order_relaxed);
      return;
    }
    int64_t none = -1;
    bad_tok.compare_exchange_strong(none, tok);
    bad.store(1);
  }
  std::string at_token() const {
    const int64_t tok = bad_tok.load();
    return tok < 0 ? "" : " at token " + std::to_string(tok);
  }
};

// The pieces of [0, n) a thread runs in a light phase: all of it inline (c.nth == 1); in a parallel
// one, chunks claimed from c.light_next until none is left, the phase being dynamic (light()). With
// static shares every light phase waited for the slowest pool thread, so one that had lost its core
// could hold the task up (the likely cause of 30-40 us quant1 and reduce phases of a T = 4 GGUF task on
// the H200 host in session 16; the H100 host showed no difference either way in session 23). A loop
// object, not a callback: ph_reduce is compiled for AVX2 (a lambda would not be).
// A claim is min_chunk units, or 1/kClaimsPerThread of a thread's share when that is more: every claim
// is an atomic add on one cache line that all the phase's threads write, and at prefill sizes one-unit
// claims serialized on it (H100 host, T = 4096 on the Qwen3-30B-A3B layer, 15 threads: quant2 6.1 ms and
// reduce 7.2 ms of a 65 ms task with 32768 one-slot and 16384 two-unit claims, ~37 GB/s of their traffic).
constexpr int64_t kClaimsPerThread = 8;
struct Pieces {
  Ctx& c;
  const int64_t n, chunk;
  bool started = false;
  Pieces(Ctx& c_, int64_t n_, int64_t min_chunk)
      : c(c_), n(n_), chunk(std::max(min_chunk, n / (int64_t(c_.nth) * kClaimsPerThread))) {}
  bool next(int64_t& b, int64_t& e) {
    if (c.nth == 1) {
      if (started) return false;
      started = true;
      b = 0;
      e = n;
      return b < e;
    }
    b = c.light_next.fetch_add(chunk, std::memory_order_relaxed);
    if (b >= n) return false;
    e = std::min(n, b + chunk);
    return true;
  }
};

// x is converted once per token, then copied to the token's slots (rows grouped by expert).
void ph_quant_tokens(int tid, void* p) {
  Ctx& c = *static_cast<Ctx*>(p);
  const uint8_t* x = static_cast<const uint8_t*>(c.t->x);
  int64_t b, e;
  for (Pieces pc{c, c.t->T, 1}; pc.next(b, e);)
    for (int64_t r = b; r < e; ++r)
      if (!c.k->quant_row(c.d->method, x + r * c.d->H * c.xes, c.t->x_dtype, c.d->H, c.d->Hp, c.d->group,
                          c.XQ + r * c.ld1, c.XS + r, c.XG + r * c.gs1))
        c.mark_bad(r);
}

void ph_gather(int tid, void* p) {
  Ctx& c = *static_cast<Ctx*>(p);
  int64_t b, e;
  for (Pieces pc{c, c.ngsl, 4}; pc.next(b, e);)
    for (int64_t i = b; i < e; ++i) {
      const int64_t s = c.gsl[i];
      int64_t r = c.slot_tok[s];
      std::memcpy(c.A1 + s * c.ld1, c.XQ + r * c.ld1, size_t(c.ld1));
      c.sx1[s] = c.XS[r];
      std::memcpy(c.g1 + s * c.gs1, c.XG + r * c.gs1, size_t(c.gs1) * 4);
    }
}

// x -> bf16 precision (round to nearest even; NaN and Inf stay so), kept as fp32
inline void round_to_bf16(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &x[i], 4);
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000u;
    std::memcpy(&x[i], &u, 4);
  }
}

// slot s's activation row -> the w2 GEMM's input format
void quant2_slot(Ctx& c, int64_t s) {
  if (c.round_act_bf16) round_to_bf16(c.af + s * c.d->Ip, c.d->I);
  if (!c.k->quant_row(c.d->method, c.af + s * c.d->Ip, DT_F32, c.d->I, c.d->Ip, c.d->group, c.A2 + s * c.ld2,
                      c.sx2 + s, c.g2 + s * c.gs2))
    c.mark_bad(c.slot_tok[s]);
}

void ph_quant2(int tid, void* p) {
  Ctx& c = *static_cast<Ctx*>(p);
  int64_t b, e;
  for (Pieces pc{c, c.S, 1}; pc.next(b, e);)
    for (int64_t s = b; s < e; ++s) quant2_slot(c, s);
}

HM_AVX2 void reduce_done(Ctx& c, int nb0, int nb1, int M, int g);

// One w13 item: the gate/up GEMM of its rows and N-blocks into C, the activation into af; the conversion of the
// activation where fused (fuse_q2: the 256-column block whose last item this is; fuse_q2row: the expert's rows
// after its last item, then edone[e] one past the expert's N-block count, the rows' ready mark for ph_gemm<2>).
HM_AVX2 void w13_item(Ctx& c, const Item& it, float* C) {
  const LayerDesc& d = *c.d;
  int64_t r0 = c.ws->offs[size_t(it.e)] + it.m0;
  int M = it.m1 - it.m0;
  if (c.lora) lora_prefetch(*c.lora, 0, it.e, r0, M, it.nb0, it.nb1);  // lands during the GEMM
  // one row: the token's row of XQ as it is (XQ holds PADROWS spare rows like A1)
  const int64_t xr = M == 1 ? c.slot_tok[r0] : -1;
  ActView A = xr >= 0 ? ActView{c.XQ + xr * c.ld1, c.ld1, c.XS + xr, c.XG + xr * c.gs1, c.gs1, c.prefetch}
                      : ActView{c.A1 + r0 * c.ld1, c.ld1, c.sx1 + r0, c.g1 + r0 * c.gs1, c.gs1, c.prefetch};
  A.block_prefetch = c.block_prefetch;
  int64_t ldc = int64_t(it.nb1 - it.nb0) * 16;
  c.k->gemm(d.method, d.w13, it.e, A, M, it.nb0, it.nb1, C, ldc, d.group);
  if (c.lora) lora_gate_up(*c.lora, it.e, r0, M, it.nb0, it.nb1, C, ldc);  // before the activation
  for (int r = 0; r < M; ++r)
    for (int pr = 0; pr < (it.nb1 - it.nb0) / 2; ++pr) {
      const float* g = C + r * ldc + pr * 32;
      act16(d, g, g + 16, c.af + (r0 + r) * d.Ip + (it.nb0 / 2 + pr) * 16);
    }
  if (c.fuse_q2) {  // the last item of its block converts the block's rows (acq_rel: sees the others' af)
    const int kb = it.nb0 / QNB, n = it.nb1 - it.nb0;
    std::atomic<int>& done = c.ws->qdone[size_t(c.ws->qbase[size_t(it.e)] + (it.m0 / MC) * (d.Ip / QBLK) + kb)];
    if (done.fetch_add(n, std::memory_order_acq_rel) + n == QNB) {
      for (int r = 0; r < M; ++r)
        if (!c.k->quant_block(c.af + (r0 + r) * d.Ip, d.Ip, kb, c.A2 + (r0 + r) * c.ld2))
          c.mark_bad(c.slot_tok[r0 + r]);
      if (c.chain) c.ws->edone[size_t(it.e)].v.fetch_add(1, std::memory_order_release);  // a block of Ip / QBLK
    }
  } else if (c.fuse_q2row) {  // the expert's last item converts its rows (acq_rel: sees the others' af)
    const int n = it.nb1 - it.nb0;
    std::atomic<int64_t>& done = c.ws->edone[size_t(it.e)].v;
    if (done.fetch_add(n, std::memory_order_acq_rel) + n == d.w13.N / 16) {
      for (int r = 0; r < M; ++r) quant2_slot(c, r0 + r);
      done.fetch_add(1, std::memory_order_release);  // ready (ph_gemm<2>'s w2 items of this expert wait for it)
    }
  }
}

HM_AVX2 void w2_item(Ctx& c, const Item& it) {
  const LayerDesc& d = *c.d;
  int64_t r0 = c.ws->offs[size_t(it.e)] + it.m0;
  int M = it.m1 - it.m0;
  if (c.lora) lora_prefetch(*c.lora, 1, it.e, r0, M, it.nb0, it.nb1);
  ActView A{c.A2 + r0 * c.ld2, c.ld2, c.sx2 + r0, c.g2 + r0 * c.gs2, c.gs2, c.prefetch};
  A.block_prefetch = c.block_prefetch;
  c.k->gemm(d.method, d.w2, it.e, A, M, it.nb0, it.nb1, c.y + r0 * d.Hp + it.nb0 * 16, d.Hp, d.group);
  if (c.lora) lora_down(*c.lora, it.e, r0, M, it.nb0, it.nb1, c.y + r0 * d.Hp + it.nb0 * 16, d.Hp);
  if (c.fuse_red) reduce_done(c, it.nb0, it.nb1, M, c.ws->egroup[size_t(it.e)] >> 1);  // bit 1: group 1
}

// A GEMM phase: one item per claim from the thread's sub-pool's counter. STAGE < 2: the items of that stage
// (w13, w2); STAGE 2 (chain): the w13 items, then the w2 items, in one phase: a w2 item first waits for its
// expert's activation rows (edone[e] = ready_at: fuse_q2row's ready mark, or fuse_q2's blocks all
// converted). Every w13 item is claimed before any w2 item and none waits, so the wait always ends; it
// replaces the barrier between the stages, whose threads idled while the last w13 items finished.
template <int STAGE>
HM_AVX2 void ph_gemm(int tid, void* p) {
  Ctx& c = *static_cast<Ctx*>(p);
  int sub = c.pool->sub_of(tid);
  int64_t beg = c.sub_beg[sub], n = c.sub_beg[sub + 1] - beg;
  float* C = STAGE != 1 ? c.ws->cbuf[size_t(tid)].get<float>(size_t(MC) * CW_BIG * 16) : nullptr;
  std::atomic<int64_t>& next = c.next[sub].v;
  for (;;) {  // one item per claim
    const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    if (i >= n) break;
    const Item& it = c.ws->items[size_t(beg + i)];
    if (it.e < 0) {  // a LoRA rank-product unit
      lora_unit(*c.lora, STAGE == 0 ? 0 : 1, it.nb0);
      continue;
    }
    if (STAGE == 0 || (STAGE == 2 && it.stage == 0)) {
      w13_item(c, it, C);
    } else {
      if (STAGE == 2)
        while (c.ws->edone[size_t(it.e)].v.load(std::memory_order_acquire) < c.ready_at) _mm_pause();
      w2_item(c, it);
    }
  }
}

// Output unit u = (token u / nch, columns of chunk u % nch) of pair group g: out (+)= sum_j w_j * y[slot(token, j)]
// (group 1: out2).
HM_AVX2 void reduce_unit(const Ctx& c, int64_t u, int g = 0) {
  const HmTask& t = *c.t;
  const int H = c.d->H, K = t.K;
  const int64_t nch = (H + HCHUNK - 1) / HCHUNK;
  alignas(32) float acc[HCHUNK];
  int64_t tok = u / nch;
  int h0 = int(u % nch) * HCHUNK, hn = std::min(HCHUNK, H - h0);
  void* out = g ? t.out2 : t.out;
  float* of = t.out_dtype == DT_F32 ? static_cast<float*>(out) + tok * H + h0 : nullptr;
  uint16_t* ob = t.out_dtype == DT_BF16 ? static_cast<uint16_t*>(out) + tok * H + h0 : nullptr;
  for (int h = 0; h < hn; ++h) acc[h] = !t.accumulate ? 0.0f : of ? of[h] : bf16_to_f32(ob[h]);
  const int32_t* tok_slot = c.tok_slot + g * c.TK;
  for (int j = 0; j < K; ++j) {
    int32_t s = tok_slot[tok * K + j];
    if (s < 0) continue;
    const float* ys = c.y + int64_t(s) * c.d->Hp + h0;
    __m256 w = _mm256_set1_ps(c.slot_w[s]);
    int h = 0;
    for (; h + 8 <= hn; h += 8)
      _mm256_store_ps(acc + h, _mm256_fmadd_ps(w, _mm256_loadu_ps(ys + h), _mm256_load_ps(acc + h)));
    for (; h < hn; ++h) acc[h] += c.slot_w[s] * ys[h];
  }
  if (of) {
    std::memcpy(of, acc, size_t(hn) * 4);
  } else {
    int h = 0;
    for (; h + 8 <= hn; h += 8) _mm_storeu_si128(reinterpret_cast<__m128i*>(ob + h), f32_to_bf16_8(_mm256_load_ps(acc + h)));
    for (; h < hn; ++h) {
      uint32_t x;
      std::memcpy(&x, &acc[h], 4);
      ob[h] = uint16_t((x + 0x7FFF + ((x >> 16) & 1)) >> 16);
    }
  }
}

// Every group's output units (group 1's after group 0's).
HM_AVX2 void ph_reduce(int tid, void* p) {
  Ctx& c = *static_cast<Ctx*>(p);
  const int64_t nch = (c.d->H + HCHUNK - 1) / HCHUNK, units = c.t->T * nch;
  int64_t b, e;
  for (Pieces pc{c, c.ngroups * units, 2}; pc.next(b, e);)
    for (int64_t u = b; u < e; ++u) reduce_unit(c, u % units, int(u / units));
}

void nan_rows(const Ctx& c, int g);

// Group 0's output is complete: its NaN rows written (a token marked so far), then done1 set.
void finish_group0(Ctx& c) {
  if (!c.t->done1 || c.g0_done.exchange(true)) return;
  if (c.any_badrow.load()) nan_rows(c, 0);
  __atomic_store_n(c.t->done1, 1, __ATOMIC_RELEASE);
  if (c.done1_set) c.done1_set->store(true, std::memory_order_relaxed);
}

// fuse_red (one token): a w2 item of M rows over N-blocks [nb0, nb1) is done; the thread that completes a
// chunk's last N-block of every slot sums that chunk (acq_rel: it sees the other items' y). The weighted sum
// then runs spread over the threads as the chunks complete, inside the phase, instead of on the leader alone
// after its barrier (11 us of a 504 us batch-1 task on the 16-core H100 host, session 23, paid by each task:
// at deferral 2 two a layer).
// With two pair groups (each expert's rows all in one group g: fuse_red's condition) the counters and
// sums are per group, and the thread that sums group 0's last chunk sets done1.
HM_AVX2 void reduce_done(Ctx& c, int nb0, int nb1, int M, int g) {
  constexpr int kChunkNB = HCHUNK / 16;
  const int NB = c.d->w2.N / 16;
  const int64_t nch = (c.d->H + HCHUNK - 1) / HCHUNK;
  for (int ch = nb0 / kChunkNB; ch * kChunkNB < nb1; ++ch) {
    const int lo = std::max(nb0, ch * kChunkNB), hi = std::min(nb1, (ch + 1) * kChunkNB);
    const int64_t want = c.Sg[g] * (std::min(NB, (ch + 1) * kChunkNB) - ch * kChunkNB);
    const int64_t n = int64_t(hi - lo) * M;
    if (c.ws->rdone[size_t(g * c.nrc + ch)].v.fetch_add(n, std::memory_order_acq_rel) + n == want && ch < nch) {
      reduce_unit(c, ch, g);
      if (g == 0 && c.red0.fetch_add(1, std::memory_order_acq_rel) + 1 == nch) finish_group0(c);
    }
  }
}

// The output rows (of group g's output) of the tokens marked in c.badrow, NaN (HmTask.nan_rows; rare).
void nan_rows(const Ctx& c, int g) {
  const HmTask& t = *c.t;
  const int64_t H = c.d->H;
  void* out = g ? t.out2 : t.out;
  for (int64_t tok = 0; tok < t.T; ++tok) {
    if (!__atomic_load_n(&c.badrow[tok], __ATOMIC_RELAXED)) continue;
    if (t.out_dtype == DT_F32)
      std::fill_n(static_cast<float*>(out) + tok * H, H, std::numeric_limits<float>::quiet_NaN());
    else
      std::fill_n(static_cast<uint16_t*>(out) + tok * H, H, uint16_t(0x7FC0));  // bf16 quiet NaN
  }
}

constexpr int64_t kInlineRows1 = 16;  // slots up to which x is converted and gathered inline
constexpr int64_t kInlineRows2 = 8;   // slots up to which the activation is converted inline

// A light phase (conversion, gather): inline on the calling (leader) thread, or on all threads.
void light(ThreadPool& pool, Ctx& c, ThreadPool::PhaseFn fn, bool inline_) {
  if (inline_) {
    c.nth = 1;
    fn(0, &c);
  } else {
    c.nth = pool.size();
    c.light_next.store(0, std::memory_order_relaxed);  // published by parallel()'s phase hand-off
    pool.parallel(fn, &c, true);
  }
}

// N-blocks per item of the experts with few rows (decode): ~8 items a thread over all of them
// (TaskOpts::items_per_thread; a thread that finishes late holds the phase up by a part of one item), at most
// kFewItemBytes of weights (and CW_FEW blocks), at least cw; a power of two (a w13 item never straddles
// a quant block). Each item is one linear read of its weights; a thread that moves on to another item
// starts a new stream, which the hardware prefetchers take a while to follow. On the 2-core Zen 4
// machine, T=1 on the Qwen3-30B-A3B layer read 0.52-0.55 of the stream bandwidth with 64 KB w13 / 48 KB
// w2 items and 0.77 with 1 MB / 384 KB ones (interleaved in one process; 16 threads would take 128 / 96 KB ones).
int few_row_cw(const Ctx& c, const PackedMat& W, int NB, int cw) {
  int64_t blocks = 0;
  for (int e = 0; e < c.d->E; ++e) {
    const int64_t M = c.ws->count[size_t(e)];
    if (M > 0 && M < BIG_ROWS) blocks += NB;
  }
  const int64_t block_bytes = std::max<int64_t>(1, W.expert_stride / std::max(1, NB));
  const int64_t want = std::min(blocks / (c.items_per_thread * int64_t(c.pool->size())), kFewItemBytes / block_bytes);
  while (cw * 2 <= want && cw * 2 <= CW_FEW) cw *= 2;
  return cw;
}

// Items for one GEMM stage, appended to the sub-pools' lists: the stage's LoRA rank-product units first
// (e = -1, nb0 = the unit; round robin over the sub-pools: GEMM items of their expert wait for them,
// lora.h), then per active expert, row chunks x N-block chunks (`cw` N-blocks per item for few rows),
// grouped by sub-pool.
// `group` >= 0: only the experts whose first pair group is that one (rows of group 0: 0; of group 1 alone: 1).
void add_items(Ctx& c, const PackedMat& W, int cw, int stage, int group) {
  const int NB = W.N / 16;
  cw = few_row_cw(c, W, NB, cw);
  Workspace& ws = *c.ws;
  const int nsub = int(ws.per_sub.size());
  const int64_t nu = c.lora && group <= 0 ? lora_units(*c.lora, stage) : 0;
  for (int64_t u = 0; u < nu; ++u) ws.per_sub[size_t(u % nsub)].push_back(Item{-1, int(u), 0, 0, 0});
  for (int e = 0; e < c.d->E; ++e) {
    if (group >= 0 && (ws.egroup[size_t(e)] & 1 ? 0 : 1) != group) continue;
    int64_t M = ws.count[size_t(e)];
    const int w = M >= BIG_ROWS ? CW_BIG : cw;
    for (int64_t m0 = 0; m0 < M; m0 += MC)
      for (int nb = 0; nb < NB; nb += w) {
        int sub = int(int64_t(nb) * nsub / NB);
        ws.per_sub[size_t(sub)].push_back(
            Item{e, nb, std::min(nb + w, NB), int(m0), int(std::min<int64_t>(M, m0 + MC)), stage});
      }
  }
}

// The items of the next phase: those of each stage given, a stage after the other within each sub-pool; with
// two pair groups, each stage's group-0 experts before its group-1 ones (chain: the two stages of group 0,
// then the two of group 1), so that group 0's output is done first.
void build_items(Ctx& c, std::initializer_list<std::tuple<const PackedMat*, int, int>> stages, bool chain = false) {
  Workspace& ws = *c.ws;
  int nsub = std::min(c.pool->num_sub(), MAXSUB);
  ws.per_sub.resize(size_t(nsub));
  for (auto& v : ws.per_sub) v.clear();
  if (c.ngroups == 1) {
    for (const auto& [W, cw, stage] : stages) add_items(c, *W, cw, stage, -1);
  } else if (chain) {
    for (int g = 0; g < 2; ++g)
      for (const auto& [W, cw, stage] : stages) add_items(c, *W, cw, stage, g);
  } else {
    for (const auto& [W, cw, stage] : stages)
      for (int g = 0; g < 2; ++g) add_items(c, *W, cw, stage, g);
  }
  ws.items.clear();
  for (int s = 0; s < nsub; ++s) {
    c.sub_beg[s] = int64_t(ws.items.size());
    ws.items.insert(ws.items.end(), ws.per_sub[size_t(s)].begin(), ws.per_sub[size_t(s)].end());
    c.next[s].v.store(0);
  }
  c.sub_beg[nsub] = int64_t(ws.items.size());
}

// The counters of the fused activation conversion: one per (expert, MC-row chunk, QBLK block), zero.
void prepare_qdone(Ctx& c) {
  Workspace& ws = *c.ws;
  const int E = c.d->E, nkb = c.d->Ip / QBLK;
  ws.qbase.assign(size_t(E) + 1, 0);
  for (int e = 0; e < E; ++e)
    ws.qbase[size_t(e) + 1] = ws.qbase[size_t(e)] + (ws.count[size_t(e)] + MC - 1) / MC * nkb;
  const int64_t n = ws.qbase[size_t(E)];
  if (n > ws.qcap) {
    ws.qdone.reset(new std::atomic<int>[size_t(n)]);
    ws.qcap = n;
  }
  for (int64_t i = 0; i < n; ++i) ws.qdone[size_t(i)].store(0, std::memory_order_relaxed);
}

// The counters of the fused per-expert activation conversion: one per expert with rows, zero.
void prepare_edone(Ctx& c) {
  Workspace& ws = *c.ws;
  const int64_t E = c.d->E;
  if (E > ws.ecap) {
    ws.edone.reset(new Counter[size_t(E)]);
    ws.ecap = E;
  }
  for (int64_t e = 0; e < E; ++e)
    if (ws.count[size_t(e)] > 0) ws.edone[size_t(e)].v.store(0, std::memory_order_relaxed);
}

// The counters of the fused weighted sum: one per HCHUNK chunk of the w2 output columns and pair group, zero.
void prepare_rdone(Ctx& c) {
  Workspace& ws = *c.ws;
  c.nrc = (c.d->w2.N / 16 + HCHUNK / 16 - 1) / (HCHUNK / 16);
  const int64_t n = c.nrc * c.ngroups;
  if (n > ws.rcap) {
    ws.rdone.reset(new Counter[size_t(n)]);
    ws.rcap = n;
  }
  for (int64_t i = 0; i < n; ++i) ws.rdone[size_t(i)].v.store(0, std::memory_order_relaxed);
}

// Pairs i of [0, ngroups * TK): group i / TK, pair i % TK of ids (group 0) or ids2 (group 1), both weighted by
// weights[i % TK]. Each expert's slots hold its group-0 rows first.
std::string route(Ctx& c) {
  const HmTask& t = *c.t;
  Workspace& ws = *c.ws;
  const int E = c.d->E;
  const int64_t TK = c.TK, NP = c.ngroups * TK;
  ws.count.assign(size_t(E), 0);
  ws.offs.assign(size_t(E) + 1, 0);
  ws.egroup.assign(size_t(E), 0);
  auto id_at = [&](int64_t i) -> int64_t {
    const void* ids = i < TK ? t.ids : t.ids2;
    i %= TK;
    return t.ids_dtype == 1 ? static_cast<const int64_t*>(ids)[i] : static_cast<const int32_t*>(ids)[i];
  };
  // nan_rows: every pair of a token with a non-finite routing weight is left out (its row is NaN)
  auto dropped = [&](int64_t i) { return c.badrow && c.badrow[(i % TK) / t.K]; };
  for (int64_t i = 0; i < NP; ++i) {
    int64_t id = id_at(i);
    if (id < 0) continue;
    if (id >= E) return "expert id " + std::to_string(id) + " out of range [0, " + std::to_string(E) + ")";
    if (!std::isfinite(t.weights[i % TK])) {
      if (!c.badrow) return "non-finite routing weight at token " + std::to_string((i % TK) / t.K);
      c.mark_bad((i % TK) / t.K);
    }
  }
  for (int64_t i = 0; i < NP; ++i) {
    int64_t id = id_at(i);
    if (id < 0 || (t.skip && t.skip[id]) || dropped(i)) continue;
    ws.count[size_t(id)]++;
    ws.egroup[size_t(id)] |= uint8_t(1 << (i / TK));
    c.Sg[i / TK]++;
  }
  for (int e = 0; e < E; ++e) ws.offs[size_t(e) + 1] = ws.offs[size_t(e)] + ws.count[size_t(e)];
  c.S = ws.offs[size_t(E)];
  c.gsl = ws.gsl.get<int32_t>(size_t(c.S) + 1);
  c.ngsl = 0;
  for (int e = 0; e < E; ++e)
    if (ws.count[size_t(e)] > 1)
      for (int64_t s = ws.offs[size_t(e)]; s < ws.offs[size_t(e) + 1]; ++s) c.gsl[c.ngsl++] = int32_t(s);
  c.slot_tok = ws.slot_tok.get<int32_t>(size_t(c.S) + 1);
  c.slot_w = ws.slot_w.get<float>(size_t(c.S) + 1);
  c.tok_slot = ws.tok_slot.get<int32_t>(size_t(NP) + 1);
  ws.pos.assign(ws.offs.begin(), ws.offs.end() - 1);
  for (int64_t i = 0; i < NP; ++i) {
    int64_t id = id_at(i);
    if (id < 0 || (t.skip && t.skip[id]) || dropped(i)) {
      c.tok_slot[i] = -1;
      continue;
    }
    int64_t s = ws.pos[size_t(id)]++;
    c.slot_tok[s] = int32_t((i % TK) / t.K);
    c.slot_w[s] = t.weights[i % TK];
    c.tok_slot[i] = int32_t(s);
  }
  return "";
}

}  // namespace

// Phase timing (seconds, summed over tasks): route, quant1, gemm1, quant2, gemm2, reduce, task count,
// and LoRA set-up (lora_begin: the rows' slots and the units; the units run inside gemm1 and gemm2).
double g_profile[8] = {0};
namespace {
struct Stopwatch {
  std::chrono::steady_clock::time_point t = std::chrono::steady_clock::now();
  void lap(int i) {
    auto n = std::chrono::steady_clock::now();
    g_profile[i] += std::chrono::duration<double>(n - t).count();
    t = n;
  }
};
}  // namespace

std::string run_moe_task(ThreadPool& pool, Workspace& ws, const HmTask& t, const TaskOpts& opts) {
  const int fuse = opts.fuse, reduce_inline_rows = opts.reduce_inline_rows;
  if (!t.layer) return "null layer";
  const HmLayer& L = *static_cast<const HmLayer*>(t.layer);
  const LayerDesc& d = L.d;
  if (t.T < 0 || t.K < 1 || t.K > 256) return "bad task shape (T or K)";
  if (t.T == 0) return "";
  if (!t.x || !t.ids || !t.weights || !t.out) return "null tensor pointer";
  if ((t.x_dtype != DT_F32 && t.x_dtype != DT_BF16) || (t.out_dtype != DT_F32 && t.out_dtype != DT_BF16) ||
      (t.ids_dtype != 0 && t.ids_dtype != 1))
    return "unsupported dtype";
  if ((t.ids2 != nullptr) != (t.out2 != nullptr)) return "a second pair group needs both ids2 and out2";
  if (t.T * int64_t(t.K) * (t.ids2 ? 2 : 1) >= (int64_t(1) << 31)) return "too many tokens";
  Ctx c;
  c.t = &t;
  c.ngroups = t.ids2 ? 2 : 1;
  c.TK = t.T * int64_t(t.K);
  c.d = &d;
  c.k = L.k;
  // The AVX-512/AMX BF16 kernels take bf16 activations. fp32 x (an fp32 model) would be rounded
  // to bf16, about 3e-3 relative off the fp32 path: such tasks run the AVX2 kernel, which keeps
  // fp32 activations (same packed weights; every ISA that has AVX-512 has AVX2).
  // The other way round, with bf16 x the AVX2 kernel rounds the activation to bf16 as the
  // AVX-512/AMX ones (and the GPU) do: BF16 activations take x's precision on every ISA.
  if (L.k_fp32act && t.x_dtype == DT_F32) c.k = L.k_fp32act;
  c.round_act_bf16 = L.k_fp32act && c.k == L.k_fp32act && t.x_dtype == DT_BF16;
  c.pool = &pool;
  c.ws = &ws;
  c.prefetch = opts.prefetch_bytes;
  c.block_prefetch = opts.block_prefetch;
  c.items_per_thread = std::clamp(opts.items_per_thread, 1, 64);
  c.done1_set = opts.done1_set;
  c.xes = t.x_dtype == DT_F32 ? 4 : 2;
  if (t.nan_rows) {
    c.badrow = ws.badrow.get<uint8_t>(size_t(t.T));
    std::memset(c.badrow, 0, size_t(t.T));
  }
  if (L.lora.w && t.lora_idx) lora_warm(L.lora, t.lora_idx, t.T);
  Stopwatch sw;
  std::string err = route(c);
  if (!err.empty()) return err;
  if (c.S > 0) {
    const int G = d.method == M_INT4 ? d.group : 64;
    c.ld1 = c.k->act_row_bytes(d.method, d.Hp);
    c.ld2 = c.k->act_row_bytes(d.method, d.Ip);
    c.gs1 = d.Hp / G;
    c.gs2 = d.Ip / G;
    size_t rows = size_t(c.S) + PADROWS;
    c.A1 = ws.a1.get<uint8_t>(rows * size_t(c.ld1));
    c.A2 = ws.a2.get<uint8_t>(rows * size_t(c.ld2));
    c.sx1 = ws.sx1.get<float>(rows);
    c.sx2 = ws.sx2.get<float>(rows);
    c.g1 = ws.g1.get<int32_t>(rows * size_t(c.gs1));
    c.g2 = ws.g2.get<int32_t>(rows * size_t(c.gs2));
    c.af = ws.af.get<float>(size_t(c.S) * size_t(d.Ip));
    c.y = ws.y.get<float>(size_t(c.S) * size_t(d.Hp));
    sw.lap(0);
    c.XQ = ws.xq.get<uint8_t>((size_t(t.T) + PADROWS) * size_t(c.ld1));
    c.XS = ws.xs.get<float>(size_t(t.T) + PADROWS);
    c.XG = ws.xg.get<int32_t>((size_t(t.T) + PADROWS) * size_t(c.gs1));
    // Decode-sized tasks convert their few rows on the leader alone: a parallel phase costs a
    // wake-up and a barrier of every thread (several us), more than the work itself.
    light(pool, c, ph_quant_tokens, c.S <= kInlineRows1);
    if (c.bad.load()) return "input x holds NaN or Inf" + c.at_token();
    if (c.ngsl) light(pool, c, ph_gather, c.ngsl <= kInlineRows1);
    sw.lap(1);
    c.lora = lora_begin(L.lora, L.isa, t.lora_idx, t.x, t.x_dtype, d.H, t.T, c.S, c.slot_tok, ws.offs.data());
    sw.lap(7);
    c.fuse_q2 = c.k->quant_block && !c.round_act_bf16 && d.I == d.Ip && d.Ip % QBLK == 0 && d.w13.N == 2 * d.Ip;
    if (c.fuse_q2) prepare_qdone(c);
    // Few rows an expert (decode): each expert's rows are converted by the thread that completes its last
    // w13 item, inside the phase, not by the leader alone after the phase's barrier (~6 us of a batch-1 task
    // on the 16-core H100 host, session 23, paid by each task). Not with LoRA: its mid step reads every
    // expert's activation after the phase, before the conversion.
    const bool few = *std::max_element(ws.count.begin(), ws.count.end()) <= kFuseQuantRows;
    c.fuse_q2row = !c.fuse_q2 && !c.lora && (fuse & kFuseQuant) && few;
    // GGUF (fuse_q2) converts per 256-column block inside the phase anyway: chained when few rows and no LoRA
    c.chain = (fuse & kFuseChain) && (c.fuse_q2row || (c.fuse_q2 && few && !c.lora));
    c.ready_at = c.fuse_q2row ? d.w13.N / 16 + 1 : d.Ip / QBLK;
    if (c.fuse_q2row || c.chain) prepare_edone(c);
    // (two pair groups: only where each expert's rows are of one group, the counters being per group)
    c.fuse_red = (fuse & kFuseReduce) && t.T == 1 &&
                 std::none_of(ws.egroup.begin(), ws.egroup.end(), [](uint8_t g) { return g == 3; });
    if (c.fuse_red) {
      prepare_rdone(c);
      for (int g = 0; g < c.ngroups; ++g) {  // a group without rows: its output now (zeros, or as accumulated)
        if (c.Sg[g]) continue;
        for (int64_t ch = 0; ch < (d.H + HCHUNK - 1) / HCHUNK; ++ch) reduce_unit(c, ch, g);
        if (g == 0) finish_group0(c);
      }
    }
    // items from a counter: a dynamic phase where one sub-pool holds them all (with several, the
    // leader's fn drains its own sub-pool's items only)
    const bool dyn = pool.num_sub() == 1;
    if (c.chain) {  // both GEMM stages in one phase (ph_gemm<2>)
      build_items(c, {{&d.w13, CW1, 0}, {&d.w2, CW2, 1}}, true);
      pool.parallel(ph_gemm<2>, &c, dyn);
      sw.lap(2);
      if (c.bad.load())
        return "expert activation holds NaN or Inf (an overflow, or non-finite expert weights)" + c.at_token();
      sw.lap(3);
      sw.lap(4);
    } else {
    build_items(c, {{&d.w13, CW1, 0}});
    pool.parallel(ph_gemm<0>, &c, dyn);
    if (c.lora) lora_mid(*c.lora, c.af);  // the down units read the activations before they are quantized
    sw.lap(2);
    if (!c.fuse_q2 && !c.fuse_q2row) light(pool, c, ph_quant2, c.S <= kInlineRows2);
    if (c.bad.load())  // the token's values overflowed, or the expert's weights hold NaN (a damaged GGUF block's scale)
      return "expert activation holds NaN or Inf (an overflow, or non-finite expert weights)" + c.at_token();
    sw.lap(3);
    build_items(c, {{&d.w2, CW2, 1}});
    pool.parallel(ph_gemm<1>, &c, dyn);
    sw.lap(4);
    }
  } else {
    c.y = nullptr;
  }
  // a decode-sized sum (T * K <= 16 rows of H) costs a few us on one thread, less than a phase, on the
  // 2-core Zen 4; on the 16-core H100 host the T=1 sum took 11 us of a 504 us Qwen3-30B-A3B task (its rows
  // written by other cores): reduce_inline_rows lets benchmarks compare (bench_cpu_moe --reduce-inline)
  if (!c.fuse_red) light(pool, c, ph_reduce, c.ngroups * c.TK <= reduce_inline_rows);
  if (c.any_badrow.load()) {
    if (!c.g0_done.load()) nan_rows(c, 0);
    if (c.ngroups == 2) nan_rows(c, 1);
  }
  finish_group0(c);  // (unless the fused sum did)
  sw.lap(5);
  g_profile[6] += 1;  // task count
  return "";
}

}  // namespace hm
