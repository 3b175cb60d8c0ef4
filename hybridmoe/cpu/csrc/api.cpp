// The C ABI loaded by hybridmoe/cpu/native.py through ctypes: the ABI version, pools, layers,
// submit / sync from Python, the phase profile and the stream-read probe. Host functions and
// gated submits are in hostcall.cpp, the trace in trace.cpp. Tensors cross as raw pointers and
// shapes; nothing here depends on torch. Compiled for baseline x86-64: every entry point that could
// reach AVX2 code first checks the CPU (dispatch.cpp), so a missing ISA is an error, never SIGILL.
// Errors inside a task are caught, recorded with the task id, and returned by hm_sync.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <string>

#include "common.h"
#include "moe.h"
#include "pool.h"
#include "quantize.h"

extern "C" int hm_isa_check(int isa, char* msg, int len);

namespace hm {
const Kernels* kernels_checked(int isa);
bool cpu_has_vbmi();
extern double g_profile[8];

std::string check_settings(const HmPoolSettings& s) {
  if (s.prefetch_bytes < 0 || s.prefetch_bytes > (1 << 20)) return "prefetch_bytes must be in [0, 1048576]";
  if (s.spin_us < 0 || s.spin_us > 1000000) return "spin_us must be in [0, 1000000]";
  if (s.hostfn_spin_us < -1 || s.hostfn_spin_us > 1000000) return "hostfn_spin_us must be in [-1, 1000000]";
  if (!std::isfinite(s.gate_timeout_s) || s.gate_timeout_s <= 0 || s.gate_timeout_s > 86400)
    return "gate_timeout_s must be in (0, 86400]";
  return "";
}

int64_t submit_task(Pool* pool, const HmTask& t, int32_t* go, int32_t* done) {
  const int64_t t_sub = !go && pool->tracing.load(std::memory_order_relaxed) ? now_ns() : 0;
  const int64_t timeout_ns = int64_t(pool->settings.gate_timeout_s * 1e9);
  const int prefetch = int(pool->settings.prefetch_bytes);
  const int64_t id = pool->tp.submit([pool, t, go, done, timeout_ns, prefetch] {
    // *done = 1 on every way out (a skipped or failed task too): a stream waiting on it must never hang.
    // The release store makes the output visible first (the GPU reads pinned memory coherently).
    // HmTask.done1 (the first pair group's output) likewise, unless the task published it already: the
    // stream waits for done1 while the second group runs and clears it, so a second 1 here would stay set
    // and let the stream's next wait on it pass before the next task's output is written (session 32: the
    // flaky tests/cpu/test_hybrid.py::test_stream_forward_interrupted_with_deferred_work[memop])
    std::atomic<bool> done1_set{false};
    struct MarkDone {
      int32_t *d, *d1;
      const std::atomic<bool>* d1_set;
      ~MarkDone() {
        if (d1 && !d1_set->load(std::memory_order_relaxed)) __atomic_store_n(d1, 1, __ATOMIC_RELEASE);
        if (d) __atomic_store_n(d, 1, __ATOMIC_RELEASE);
      }
    } mark{done, t.done1, &done1_set};
    std::string err;
    const int64_t my_id = pool->tp.completed() + 1;  // tasks run in order
    if (go) {  // for the trace, a gated task counts as submitted when the GPU released it
      if (!wait_go(go, timeout_ns)) {
        char msg[160];
        std::snprintf(msg, sizeof(msg), "CPU MoE task skipped: the GPU did not release it within the gate timeout "
                      "(CPUEngineSettings.gate_timeout_s = %g s)", pool->settings.gate_timeout_s);
        pool->record(msg);
        return;
      }
      pool->ev(0, my_id);
    }
    pool->ev(1, my_id);
    try {
      TaskOpts opts = pool->task_opts(prefetch);
      opts.done1_set = &done1_set;
      err = run_moe_task(pool->tp, *pool->ws, t, opts);
    } catch (const std::exception& e) {
      err = std::string("CPU MoE task failed: ") + e.what();
    } catch (...) {
      err = "CPU MoE task failed (unknown exception)";
    }
    if (!err.empty()) pool->record(err);
    pool->ev(2, my_id);
  });
  if (t_sub) pool->ev(0, id, t_sub);
  return id;
}

}  // namespace hm

namespace {

using hm::Pool;

void put(char* buf, int len, const std::string& s) {
  if (buf && len > 0) std::snprintf(buf, size_t(len), "%s", s.c_str());
}

}  // namespace

extern "C" {

int hm_abi_version() { return 26; }  // 26: HmHostCall.done (stream memory-operation waits), HmTask.ids2 / out2 / done1 (a second pair group); 25: hm_pool_block_prefetch, hm_pool_items_per_thread; 24: hm_pool_fuse (was hm_pool_fused_reduce); 23: hm_pool_fused_reduce; 22: hm_amx_emulated; 21: hm_pool_reduce_inline; 20: HmTask.nan_rows, hm_argmax_bf16's nonfinite mark; 19: hm_attn_kernel (the AVX-512 decode attention span); 18: hm_pool_prefetch; 17: hm_pool_selftest, hm_pool_dynamic (dynamic pool phases); 16: hm_layers_decode (HmDecodeStack), hm_layer_profile, hm_pool_leader_spin; 15: hm_topk_softmax (route_cpu.cpp), HmLayerDecode.moe; 14: hm_run_task (inline on the caller); 11: hm_quantize (quantize.cpp); 12: hm_gguf_layer_create (gguf_api.cpp); 13: HmTask.lora_idx, HmLayer.lora, hm_layer_attach_lora

void* hm_pool_create(int n, const int* cpus, int nsub, const HmPoolSettings* settings, char* err, int errlen) {
  char why[256];
  if (!hm_isa_check(hm::ISA_AVX2, why, sizeof(why))) {
    put(err, errlen, std::string("the CPU engine needs AVX2: ") + why);
    return nullptr;
  }
  if (!settings) {
    put(err, errlen, "null pool settings");
    return nullptr;
  }
  const std::string bad = hm::check_settings(*settings);
  if (!bad.empty()) {
    put(err, errlen, "CPU engine settings: " + bad);
    return nullptr;
  }
  try {
    return new Pool(n, cpus, nsub, *settings);
  } catch (const std::exception& e) {
    put(err, errlen, e.what());
    return nullptr;
  }
}

void hm_pool_destroy(void* p) { delete static_cast<Pool*>(p); }
int hm_pool_size(void* p) { return static_cast<Pool*>(p)->tp.size(); }
int hm_pool_num_sub(void* p) { return static_cast<Pool*>(p)->tp.num_sub(); }
// The settings the pool was created with.
void hm_pool_settings(void* p, HmPoolSettings* out) { *out = static_cast<Pool*>(p)->settings; }

void* hm_layer_create(const hm::LayerDesc* d, int isa, char* err, int errlen) {
  char why[512];
  if (!hm_isa_check(isa, why, sizeof(why))) {
    put(err, errlen, why);
    return nullptr;
  }
  const hm::Kernels* k = hm::kernels_checked(isa);
  std::string bad;
  if (d->method < hm::M_INT8 || d->method > hm::M_FP8) bad = "unknown method";
  else if (d->method == hm::M_INT4 && d->group != 32 && d->group != 64 && d->group != 128) bad = "int4 group must be 32, 64 or 128";
  else if (d->Hp % 64 || d->Ip % 64 || d->Hp < d->H || d->Ip < d->I || d->H < 1 || d->I < 1 || d->E < 1) bad = "bad padded sizes";
  else if (d->w13.N != 2 * d->Ip || d->w13.Kd != d->Hp || d->w2.N != d->Hp || d->w2.Kd != d->Ip) bad = "matrix shapes disagree with sizes";
  else if (d->method == hm::M_FP8 && (d->group < 32 || d->group % 32)) bad = "fp8 block K (group) must be a multiple of 32";
  else if ((d->method == hm::M_INT4 || d->method == hm::M_FP8) && (d->Hp % d->group || d->Ip % d->group))
    bad = "padded sizes not a multiple of the group";
  else if (!d->w13.data || !d->w2.data || (d->method != hm::M_BF16 && (!d->w13.scale || !d->w2.scale)) ||
           (d->method == hm::M_INT8 && (!d->w13.wsum || !d->w2.wsum)))
    bad = "null weight pointer";
  else if (d->act < hm::ACT_SILU || d->act > hm::ACT_SWIGLU_CLAMP) bad = "unknown activation";
  if (!bad.empty()) {
    put(err, errlen, bad);
    return nullptr;
  }
  // the AVX-512/AMX FP8 widening needs AVX512-VBMI (every AVX-512 BF16 CPU but Cooper Lake has it):
  // without it FP8 runs the AVX2 kernels (same results; hm_layer_kernel_name says "avx2")
  if (d->method == hm::M_FP8 && isa >= hm::ISA_AVX512 && !hm::cpu_has_vbmi()) {
    k = hm::kernels_checked(hm::ISA_AVX2);
    isa = hm::ISA_AVX2;
  }
  return new hm::HmLayer{*d, k, isa, d->method == hm::M_BF16 ? hm::kernels_checked(hm::ISA_AVX2) : nullptr};
}

void hm_layer_destroy(void* l) { delete static_cast<hm::HmLayer*>(l); }
const char* hm_layer_kernel_name(void* l) { return static_cast<hm::HmLayer*>(l)->k->name; }

// Queues the task and returns its id at once. Pointers must stay valid until it completes.
int64_t hm_submit(void* p, const HmTask* task) {
  return hm::submit_task(static_cast<Pool*>(p), *task, nullptr, nullptr);
}

// Waits for task `id` (id > 0) or until at most max_pending tasks remain (id <= 0). Returns 0, or 1
// with the first error of the finished tasks (all their errors are then cleared) in err.
int hm_sync(void* p, int64_t id, int64_t max_pending, char* err, int errlen) {
  Pool* pool = static_cast<Pool*>(p);
  if (id > 0)
    pool->tp.wait_task(id);
  else
    pool->tp.wait_pending(max_pending);
  std::lock_guard<std::mutex> lk(pool->em);
  if (pool->errors.empty()) return 0;
  std::string msg = "task " + std::to_string(pool->errors.front().first) + ": " + pool->errors.front().second;
  if (pool->errors.size() > 1) msg += " (and " + std::to_string(pool->errors.size() - 1) + " more failed tasks)";
  pool->errors.clear();
  put(err, errlen, msg);
  return 1;
}

// Runs the task and waits for it: on the calling thread in the leader's place when the pool is idle
// (ThreadPool::run_inline: no hand-off, no wake-up; the synchronous CPU-only path), else queued
// behind the pool's tasks (the caller spins spin_us, < 0: the pool's, then sleeps). Returns 0, or 1
// with the error of this task or of earlier failed ones (as hm_sync) in err.
int hm_run_task(void* p, const HmTask* task, int64_t spin_us, char* err, int errlen) {
  Pool* pool = static_cast<Pool*>(p);
  struct Run {
    Pool* pool;
    const HmTask* t;
    std::string err;
  } run{pool, task, ""};
  auto fn = [](void* r) {
    Run& x = *static_cast<Run*>(r);
    try {
      x.err = hm::run_moe_task(x.pool->tp, *x.pool->ws, *x.t, x.pool->task_opts(int(x.pool->settings.prefetch_bytes)));
    } catch (const std::exception& e) {
      x.err = std::string("CPU MoE task failed: ") + e.what();
    } catch (...) {
      x.err = "CPU MoE task failed (unknown exception)";
    }
  };
  // A layer on the AMX path keeps its task on the pool's threads unless hm_pool_inline(p, 2): on the
  // H200 host the inline run of an AMX task on the calling (Python) thread died with SIGILL
  // (tests/cpu/test_layer_decode.py under HYBRIDMOE_CPU_ISA=amx), while the pool threads have run the
  // AMX kernels all along. The likely cause, fixed in moe_amx.cpp configure_tiles: a per-thread
  // "tiles configured" flag, stale after torch's AMX matmuls released the caller's tiles. Inline stays
  // off for AMX until tests/cpu/test_amx_caller_thread.py has passed on an AMX host.
  const bool amx = task->layer && static_cast<const hm::HmLayer*>(task->layer)->isa == hm::ISA_AMX;
  if ((!amx || pool->inline_amx.load(std::memory_order_relaxed)) && pool->tp.run_inline(fn, &run)) {
    if (run.err.empty()) return 0;
    put(err, errlen, run.err);
    return 1;
  }
  const int64_t id = hm::submit_task(pool, *task, nullptr, nullptr);
  pool->tp.wait_task(id, spin_us < 0 ? -1 : spin_us * 1000);
  return hm_sync(p, id, 0, err, errlen);
}

// The leader thread's spin for its next task before it sleeps, in us (ThreadPool::set_leader_spin; < 0:
// the pool's spin_us); us < -1: only reads it. Returns the setting before (us; -1: the pool's).
int64_t hm_pool_leader_spin(void* p, int64_t us) {
  hm::ThreadPool& tp = static_cast<Pool*>(p)->tp;
  const int64_t was = tp.leader_spin();
  if (us >= -1) tp.set_leader_spin(us < 0 ? -1 : us * 1000);
  return was < 0 ? -1 : was / 1000;
}

// Whether synchronous calls may run on their caller (ThreadPool::run_inline): 0 no, 1 yes but not the
// tasks of AMX layers (the default), 2 those too (hm_run_task). on < 0: only reads it. Returns the
// setting before.
int hm_pool_inline(void* p, int on) {
  Pool* pool = static_cast<Pool*>(p);
  hm::ThreadPool& tp = pool->tp;
  const int was = tp.inline_on() ? (pool->inline_amx.load() ? 2 : 1) : 0;
  if (on >= 0) {
    tp.set_inline(on != 0);
    pool->inline_amx.store(on >= 2);
  }
  return was;
}

// The pool's phase protocol under test (tests/cpu/test_pool_phases.py): `phases` phases run inline on
// the caller as the leader, odd ones dynamic (`items` items claimed from a counter, each counted in
// item_counts[phase][item]; every 4th item spins about spin_ns), even ones classic (each thread counts
// itself in thread_counts[phase][tid]). Returns the number of dynamic phases that some thread skipped
// (joined after the work was all taken), or -1 when the pool is busy.
int64_t hm_pool_selftest(void* p, int32_t phases, int32_t items, int64_t spin_ns, int32_t* item_counts,
                         int32_t* thread_counts) {
  hm::ThreadPool& tp = static_cast<Pool*>(p)->tp;
  struct Ctx {
    int32_t items, n;
    int64_t spin_ns;
    int32_t *ic, *tc;
    std::atomic<int32_t> next{0}, joined{0};
    static void dynamic(int, void* v) {
      Ctx& c = *static_cast<Ctx*>(v);
      c.joined.fetch_add(1);
      for (int32_t i; (i = c.next.fetch_add(1)) < c.items;) {
        __atomic_fetch_add(&c.ic[i], 1, __ATOMIC_RELAXED);
        if (i % 4 == 0)
          for (auto t0 = std::chrono::steady_clock::now();
               std::chrono::steady_clock::now() - t0 < std::chrono::nanoseconds(c.spin_ns);) {
          }
      }
    }
    static void classic(int tid, void* v) {
      Ctx& c = *static_cast<Ctx*>(v);
      __atomic_fetch_add(&c.tc[tid], 1, __ATOMIC_RELAXED);
    }
  } c;
  c.items = items;
  c.n = tp.size();
  c.spin_ns = spin_ns;
  struct Run {
    hm::ThreadPool* tp;
    Ctx* c;
    int32_t phases;
    int32_t *ic, *tc;
    int64_t skipped;
  } r{&tp, &c, phases, item_counts, thread_counts, 0};
  auto body = [](void* v) {
    Run& r = *static_cast<Run*>(v);
    Ctx& c = *r.c;
    for (int32_t ph = 0; ph < r.phases; ++ph) {  // the counters of phase ph: ic + ph * items, tc + ph * n
      const bool dyn = ph % 2 == 1;
      c.next.store(0);
      c.joined.store(0);
      c.ic = r.ic + int64_t(ph) * c.items;
      c.tc = r.tc + int64_t(ph) * c.n;
      r.tp->parallel(dyn ? Ctx::dynamic : Ctx::classic, &c, dyn);
      if (dyn && c.joined.load() < c.n) ++r.skipped;
    }
  };
  if (!tp.run_inline(body, &r)) return -1;
  return r.skipped;
}

// The few-row kernels' software prefetch distance (CPUEngineSettings.prefetch_bytes), read by every
// call after this one (benchmarks compare distances in one process); bytes < 0: only reads it, else in
// [0, 1 MiB] (clamped). Returns the setting before. Call between tasks, not while one runs.
int64_t hm_pool_prefetch(void* p, int64_t bytes) {
  Pool* pool = static_cast<Pool*>(p);
  const int64_t was = pool->settings.prefetch_bytes;
  if (bytes >= 0) pool->settings.prefetch_bytes = std::min<int64_t>(bytes, 1 << 20);
  return was;
}

// Whether dynamic phases may skip threads that join late (ThreadPool::set_dynamic); on by default.
// on < 0: only reads it. Returns the setting before.
int hm_pool_dynamic(void* p, int on) {
  hm::ThreadPool& tp = static_cast<Pool*>(p)->tp;
  const int was = tp.dynamic_on() ? 1 : 0;
  if (on >= 0) tp.set_dynamic(on != 0);
  return was;
}

// Rows (T * K) up to which a task's weighted sum runs on the leader alone (run_moe_task); rows < 0:
// only reads it. Returns the setting before.
int hm_pool_reduce_inline(void* p, int rows) {
  Pool* pool = static_cast<Pool*>(p);
  const int was = pool->reduce_inline_rows.load();
  if (rows >= 0) pool->reduce_inline_rows.store(rows);
  return was;
}

// Which light phases of a MoE task run inside its GEMM phases (run_moe_task's fuse bits, moe.h: 1 the
// one-token weighted sum, 2 the few-row activation conversion; both by default). bits < 0: only reads
// them. Returns the bits before. Call between tasks.
int hm_pool_fuse(void* p, int bits) {
  Pool* pool = static_cast<Pool*>(p);
  const int was = pool->fuse.load();
  if (bits >= 0) pool->fuse.store(bits & hm::kFuseAll);
  return was;
}

// The GGUF direct kernels' next-block prefetch (common.h ActView::block_prefetch: 0 none, 1 towards L2 (the
// default), 2 towards L1); mode < 0: only reads it. Returns the mode before. Call between tasks.
int hm_pool_block_prefetch(void* p, int mode) {
  Pool* pool = static_cast<Pool*>(p);
  const int was = pool->block_prefetch.load();
  if (mode >= 0) pool->block_prefetch.store(mode > 2 ? 2 : mode);
  return was;
}

// Few-row (decode) items are sized for about this many a thread (TaskOpts::items_per_thread, 1..64, default 8:
// fewer make longer weight streams and a longer tail); n <= 0: only reads it. Returns the setting before.
int hm_pool_items_per_thread(void* p, int n) {
  Pool* pool = static_cast<Pool*>(p);
  const int was = pool->items_per_thread.load();
  if (n > 0) pool->items_per_thread.store(n > 64 ? 64 : n);
  return was;
}

int64_t hm_pending(void* p) {
  Pool* pool = static_cast<Pool*>(p);
  return pool->tp.submitted() - pool->tp.completed();
}

// Copies the phase-time sums (route, quant1, gemm1, quant2, gemm2, reduce, tasks,
// lora: the expert LoRA rank-product phases) and resets
// them when reset != 0. Read between tasks (not synchronized with a running task).
void hm_profile(double* out8, int reset) {
  for (int i = 0; i < 8; ++i) {
    out8[i] = hm::g_profile[i];
    if (reset) hm::g_profile[i] = 0;
  }
}

int64_t hm_completed(void* p) { return static_cast<Pool*>(p)->tp.completed(); }

// Stream-read bandwidth (GB/s) of a `bytes` buffer read by all pool threads, best of `iters`.
double hm_stream_read(void* p, int64_t bytes, int iters) {
  Pool* pool = static_cast<Pool*>(p);
  double gbs = 0.0;
  int64_t id = pool->tp.submit([&] {
    try {
      gbs = hm::stream_read(pool->tp, bytes, iters);
    } catch (...) {
      gbs = 0.0;
    }
  });
  pool->tp.wait_task(id);
  return gbs;
}

// Quantizes and packs one stacked matrix on all pool threads (quantize.h); waits for it. Returns 0,
// or 1 with what is wrong in err (bad arguments, or a source row with a NaN or an infinity).
int hm_quantize(void* p, const HmQuantSrc* src, const HmQuantDst* dst, char* err, int errlen) {
  Pool* pool = static_cast<Pool*>(p);
  const char* bad = hm::quantize_check(*src, *dst);
  if (*bad) {
    put(err, errlen, std::string("hm_quantize: ") + bad);
    return 1;
  }
  const HmQuantSrc s = *src;
  const HmQuantDst d = *dst;
  std::string what;
  int64_t id = pool->tp.submit([&] { what = hm::quantize_run(pool->tp, s, d); });
  pool->tp.wait_task(id);
  if (what.empty()) return 0;
  put(err, errlen, what);
  return 1;
}

}  // extern "C"
