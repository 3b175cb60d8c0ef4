// C ABI of the dense BF16 linears (dense.h): hm_dense runs one call on the engine's pool (as a
// task, so it runs after the MoE tasks queued before it and never beside them: the pool's threads
// are the only ones doing the heavy work, no oversubscription) and waits for it. Compiled for
// baseline x86-64: the ISA is checked before a kernel is chosen.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <string>
#include <vector>

#include "common.h"
#include "dense.h"
#include "pool.h"

extern "C" int hm_isa_check(int isa, char* msg, int len);

namespace {

// Weights up to this size are read by the calling thread itself (a router: 0.5 MB, ~35 us on one
// core): waking the pool and its end-of-phase barrier cost more than that, and much more when a
// pool thread shares its core with another busy process (0.2 ms measured on the 2-core machine).
// With the pool idle the caller leads a phase itself (ThreadPool::run_inline) and no hand-off is
// paid: then only matrices up to kAloneBytes are read by the caller alone (a phase of spinning threads
// costs a few us).
constexpr int64_t kInlineBytes = 1 << 20;
constexpr int64_t kAloneBytes = 64 << 10;
constexpr int64_t kQ8MaxRows = 16;  // rows of one call with int8 weights (decode sizes)

// Runs `phase` (which takes the rows in chunks from ctx: a dynamic phase) on the pool and returns when it is done:
// tiny weights (or a 1-thread pool) by `serial` on this thread alone; the pool idle: a phase this
// thread leads itself (no hand-off to the leader, no wake-up after); the pool busy: `serial` on this
// thread up to kInlineBytes (no round trip through the pool), else a task of the pool, waited for
// (spin_us: as hm_dense's).
template <class Serial>
void run_rows(hm::Pool* pool, void (*phase)(int, void*), void* ctx, int64_t bytes, int64_t spin_us, Serial serial) {
  if (bytes <= kAloneBytes || pool->tp.size() == 1) return serial();
  struct Lead {
    hm::Pool* pool;
    void (*phase)(int, void*);
    void* ctx;
  } lead{pool, phase, ctx};
  if (pool->tp.run_inline([](void* l) {
        auto& ld = *static_cast<Lead*>(l);
        ld.pool->tp.parallel(ld.phase, ld.ctx, true);  // the phases take their rows from a counter
      }, &lead))
    return;
  if (bytes <= kInlineBytes) return serial();
  const int64_t id = pool->tp.submit([pool, phase, ctx] { pool->tp.parallel(phase, ctx, true); });
  pool->tp.wait_task(id, spin_us < 0 ? -1 : spin_us * 1000);
}

struct DenseCtx {
  const HmDenseTask* t;
  hm::DenseRowsFn fn;
  int prefetch;
  int64_t chunk;                 // rows per work item (a multiple of 16)
  std::atomic<int64_t> next{0};  // the next work item
};

// Rows are handed out in chunks of up to 2 MB of weights from a shared counter, not split statically:
// a thread that shares its core with another process (a busy machine, the server's own loop) then
// does less of the work instead of holding up the phase. Chunks are multiples of 16 rows (64 bytes
// of fp32 output), so no two threads write one cache line.
void ph_dense(int, void* p) {
  DenseCtx& c = *static_cast<DenseCtx*>(p);
  const int64_t N = c.t->N;
  for (;;) {
    const int64_t n0 = c.next.fetch_add(c.chunk, std::memory_order_relaxed);
    if (n0 >= N) return;
    c.fn(*c.t, int(n0), int(std::min(n0 + c.chunk, N)), c.prefetch);
  }
}

std::string check(const HmDenseTask& t) {
  if (t.T < 0 || t.N < 0 || t.K < 1) return "T and N must be >= 0 and K >= 1";
  if (t.out_dtype != 0 && t.out_dtype != 1) return "out_dtype must be 0 (fp32) or 1 (bf16)";
  if (t.q8 && (t.q8_N < t.N || t.q8_N % 64 || t.q8_Kd < t.K || t.q8_Kd % 64 || !t.q8_scale || !t.q8_wsum))
    return "int8 weights need q8_N >= N and q8_Kd >= K, both multiples of 64, with scales and row sums";
  if (t.q8 && t.T > kQ8MaxRows) return "int8 weights take at most " + std::to_string(kQ8MaxRows) + " rows";
  if (t.T == 0 || t.N == 0) return "";
  if (!(t.w || t.q8) || !t.x || !t.out) return "null weight, input or output pointer";
  if ((!t.q8 && t.ldw < t.K) || t.ldx < t.K || t.ldo < t.N) return "a row stride is smaller than its row";
  return "";
}

// ---- INT8 weights (HmDenseTask.q8): the MoE engine's int8 kernels on one "expert" ----

struct Q8Ctx {
  const HmDenseTask* t;
  const hm::Kernels* k;
  hm::PackedMat W;
  hm::ActView A;
  int64_t chunk;                 // rows per work item (a multiple of 32: whole pairs of N-blocks)
  std::atomic<int64_t> next{0};
};

// Rows [n0, n1) of the output (n1 - n0 a multiple of 32, within q8_N): the int8 GEMM into a
// thread-local fp32 tile, then bias and the store of the rows < N.
void q8_rows(const Q8Ctx& c, int64_t n0, int64_t n1) {
  thread_local std::vector<float> tile;
  const HmDenseTask& t = *c.t;
  const int64_t w = n1 - n0;
  if (tile.size() < size_t(t.T * w)) tile.resize(size_t(t.T * w));
  c.k->gemm(hm::M_INT8, c.W, 0, c.A, int(t.T), int(n0 / 16), int(n1 / 16), tile.data(), w, 0);
  const int64_t end = std::min<int64_t>(n1, t.N);
  for (int64_t tok = 0; tok < t.T; ++tok)
    for (int64_t n = n0; n < end; ++n) hm::dense_store(t, tok, int(n), tile[size_t(tok * w + (n - n0))]);
}

void ph_q8(int, void* p) {
  Q8Ctx& c = *static_cast<Q8Ctx*>(p);
  const int64_t N = c.t->q8_N;
  for (;;) {
    const int64_t n0 = c.next.fetch_add(c.chunk, std::memory_order_relaxed);
    if (n0 >= N) return;
    q8_rows(c, n0, std::min(n0 + c.chunk, N));
  }
}

}  // namespace

extern "C" int hm_dense_isa(int isa, char* err, int errlen);

namespace {

// hm_dense with int8 weights (see HmDenseTask.q8): the activation rows quantized per token on this
// thread (as the int8 experts' are: round(x * 127 / amax), u8 offset 128), then the rows in chunks
// of ~2 MB of weights on the pool, led by this thread when the pool is idle.
int q8_dense(hm::Pool* pool, const HmDenseTask& t, int run, int64_t spin_us, char* err, int errlen) {
  const hm::Kernels* k = run == hm::ISA_AVX512 && hm_kernels_avx512 ? hm_kernels_avx512()
                         : hm_kernels_avx2 ? hm_kernels_avx2() : nullptr;
  if (!k || !k->gemm) {
    if (err && errlen > 0) std::snprintf(err, size_t(errlen), "hm_dense: the library was built without int8 kernels");
    return 1;
  }
  thread_local std::vector<uint8_t> act;
  thread_local std::vector<float> ascale;
  const int64_t rb = k->act_row_bytes(hm::M_INT8, t.q8_Kd);
  // spare bytes past the last row: the few-row kernels may read a little ahead of a row
  act.resize(size_t(rb * (t.T + 1) + 64));
  ascale.resize(size_t(t.T));
  for (int64_t r = 0; r < t.T; ++r)
    if (!k->quant_row(hm::M_INT8, t.x + r * t.ldx, hm::DT_BF16, t.K, t.q8_Kd, 0, act.data() + r * rb,
                      ascale.data() + r, nullptr)) {
      if (err && errlen > 0) std::snprintf(err, size_t(errlen), "hm_dense: row %lld of the input holds NaN or Inf",
                                           static_cast<long long>(r));
      return 1;
    }
  Q8Ctx c;
  c.t = &t;
  c.k = k;
  c.W = hm::PackedMat{t.q8, int64_t(t.q8_N) * t.q8_Kd, t.q8_scale, nullptr, t.q8_wsum, t.q8_N, t.q8_Kd};
  c.A = hm::ActView{act.data(), rb, ascale.data(), nullptr, 0, int(pool->settings.prefetch_bytes)};
  // as the bf16 rows: ~4 chunks a thread, at most 2 MB of weights, whole pairs of 16-row blocks
  const int64_t cap = std::max<int64_t>(32, (int64_t(2) << 20) / t.q8_Kd / 32 * 32);
  c.chunk = std::min(cap, std::max<int64_t>(32, int64_t(t.q8_N) / (4 * int64_t(pool->tp.size())) / 32 * 32));
  run_rows(pool, ph_q8, &c, int64_t(t.q8_N) * t.q8_Kd, spin_us, [&] { q8_rows(c, 0, t.q8_N); });
  return 0;
}

}  // namespace

extern "C" {

// The ISA a dense call on `isa` runs (AMX has no dense kernels of its own: AVX-512), or -1 with the
// reason in err.
int hm_dense_isa(int isa, char* err, int errlen) {
  char why[512] = "";
  if (!hm_isa_check(isa, why, sizeof(why))) {
    if (err && errlen > 0) std::snprintf(err, size_t(errlen), "%s", why);
    return -1;
  }
  if (isa >= hm::ISA_AVX512 && hm_dense_rows_avx512) return hm::ISA_AVX512;
  if (hm_dense_rows_avx2) return hm::ISA_AVX2;
  if (err && errlen > 0) std::snprintf(err, size_t(errlen), "the library was built without the dense kernels");
  return -1;
}

// out = x w^T (+ bias) on all pool threads (see dense.h), or on this thread for small weights;
// waits for it. spin_us: how long this
// thread spins for the result before it sleeps (< 0: the pool's spin_us). Returns 0, or 1 with
// what is wrong in err.
int hm_dense(void* p, const HmDenseTask* t, int isa, int64_t spin_us, char* err, int errlen) {
  const std::string bad = t ? check(*t) : "null task";
  if (!bad.empty()) {
    if (err && errlen > 0) std::snprintf(err, size_t(errlen), "hm_dense: %s", bad.c_str());
    return 1;
  }
  const int run = hm_dense_isa(isa, err, errlen);
  if (run < 0) return 1;
  if (t->T == 0 || t->N == 0) return 0;
  hm::Pool* pool = static_cast<hm::Pool*>(p);
  if (t->q8) return q8_dense(pool, *t, run, spin_us, err, errlen);
  const hm::DenseRowsFn fn = run == hm::ISA_AVX512 ? hm_dense_rows_avx512() : hm_dense_rows_avx2();
  DenseCtx c;
  c.t = t;
  c.fn = fn;
  c.prefetch = int(pool->settings.prefetch_bytes);
  const int64_t row_bytes = int64_t(t->K) * 2 * std::max<int64_t>(1, std::min<int64_t>(t->T, hm::kDenseTokTile));
  // ~4 chunks a thread (a late thread leaves its share to the others), at most 2 MB, >= 16 rows. Each chunk
  // is one linear stream, and a thread moving to the next one makes the hardware prefetchers start over:
  // the one-token 151936 x 2048 GEMV on 2 Zen 4 cores read 52 GB/s in 256 KB chunks and 59 GB/s in 2 MB
  // ones (4 KB pages; 60 and 68 on 2 MB pages; the stream probe 62 / 73).
  const int64_t cap = std::max<int64_t>(16, (int64_t(2) << 20) / row_bytes / 16 * 16);
  c.chunk = std::min(cap, std::max<int64_t>(16, t->N / (4 * int64_t(pool->tp.size())) / 16 * 16));
  run_rows(pool, ph_dense, &c, int64_t(t->N) * t->K * 2, spin_us, [&] { fn(*t, 0, t->N, c.prefetch); });
  return 0;
}

}  // extern "C"

extern "C" {

// Waits for task `id` of the pool, spinning spin_us first (0: sleep at once), without collecting
// errors (hm_sync does that, at once, afterwards). The CPU-only path's synchronous MoE calls use it:
// there the waiting thread has nothing else to do, and spinning it takes a core from the pool.
void hm_wait_task(void* p, int64_t id, int64_t spin_us) {
  static_cast<hm::Pool*>(p)->tp.wait_task(id, spin_us < 0 ? -1 : spin_us * 1000);
}

}  // extern "C"

extern "C" void hm_argmax_bf16_avx2(const uint16_t* x, int64_t n, int64_t rows, int64_t ld, int64_t* out,
                                    int32_t nonfinite_key, int64_t nonfinite)
    __attribute__((weak));

extern "C" {

// out[r] = torch.argmax(x[r, :n]) for bf16 rows (attn_decode.cpp), or `nonfinite` where the row holds NaN or
// +inf and mark_nonfinite is set (the sampler's NAN_ROW: no second pass over the logits); 0, or 1 without
// AVX2 / n < 1.
int hm_argmax_bf16(const uint16_t* x, int64_t n, int64_t rows, int64_t ld, int64_t* out, int32_t mark_nonfinite,
                   int64_t nonfinite) {
  if (n < 1 || rows < 0 || !hm_argmax_bf16_avx2 || !hm_isa_check(hm::ISA_AVX2, nullptr, 0)) return 1;
  hm_argmax_bf16_avx2(x, n, rows, ld, out, mark_nonfinite ? 0x7f80 : INT32_MAX, nonfinite);
  return 0;
}

}  // extern "C"

extern "C" void hm_add_rmsnorm_avx2(const uint16_t* x, const uint16_t* res, const uint16_t* w, int64_t rows, int64_t H,
                                    float eps, uint16_t* out, uint16_t* res_out) __attribute__((weak));

extern "C" {

// (norm(x + res) * w, x + res) of bf16 rows (attn_decode.cpp); 0, or 1 without AVX2.
int hm_add_rmsnorm_bf16(const uint16_t* x, const uint16_t* res, const uint16_t* w, int64_t rows, int64_t H, float eps,
                        uint16_t* out, uint16_t* res_out) {
  if (H < 1 || rows < 0 || !hm_add_rmsnorm_avx2 || !hm_isa_check(hm::ISA_AVX2, nullptr, 0)) return 1;
  hm_add_rmsnorm_avx2(x, res, w, rows, H, eps, out, res_out);
  return 0;
}

}  // extern "C"
