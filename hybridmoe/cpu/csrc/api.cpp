// The C ABI loaded by hybridmoe/cpu/native.py through ctypes. Tensors cross as raw pointers and
// shapes; nothing here depends on torch. Compiled for baseline x86-64: every entry point that could
// reach AVX2 code first checks the CPU (dispatch.cpp), so a missing ISA is an error, never SIGILL.
// Errors inside a task are caught, recorded with the task id, and returned by hm_sync.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common.h"
#include "moe.h"
#include "threadpool.h"

extern "C" int hm_isa_check(int isa, char* msg, int len);

namespace hm {
const Kernels* kernels_checked(int isa);
extern double g_profile[8];
}

namespace {

// One trace event: what happened to which task, when (steady clock, ns). Kinds: 0 submitted,
// 1 started, 2 finished, 3 a host function began waiting for it, 4 that wait returned.
struct TraceEv {
  int64_t t_ns;
  int64_t id;
  int32_t kind;
  int32_t pad_;
};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Pool {
  hm::ThreadPool tp;
  hm::Workspace* ws;
  std::mutex em;
  std::deque<std::pair<int64_t, std::string>> errors;
  // Trace ring (off unless hm_trace_start): slots taken with one atomic add, events past the
  // capacity dropped; written by the submitting, the leader and the host-function threads.
  std::vector<TraceEv> trace;
  std::atomic<int64_t> trace_n{0};
  std::atomic<bool> tracing{false};
  void ev(int kind, int64_t id, int64_t t = 0) {
    if (!tracing.load(std::memory_order_relaxed)) return;
    int64_t i = trace_n.fetch_add(1, std::memory_order_relaxed);
    if (i < int64_t(trace.size())) trace[size_t(i)] = TraceEv{t ? t : now_ns(), id, kind, 0};
  }
  Pool(int n, const int* cpus, int nsub) : tp(n, cpus, nsub), ws(hm::workspace_create(tp.size())) {}
  ~Pool() {
    tp.wait_pending(0);
    hm::workspace_destroy(ws);
  }
  void record(std::string msg) {
    std::lock_guard<std::mutex> lk(em);
    errors.emplace_back(tp.completed() + 1, std::move(msg));  // tasks run in order: this is our id
  }
};

// How long a host function's wait spins before it sleeps (ns; < 0: the pool's idle spin). The
// driver's host-function thread is not one of the pool's pinned threads: spinning, it competes
// for a core with them for as long as the task runs. Default 0 (sleep at once): on the H200 host
// a hybrid decode step was 8-17% faster than with the pool's 1 ms spin (session 5, call 1).
// HYBRIDMOE_CPU_HOSTFN_SPIN_US / hm_set_hostfn_spin_us.
std::atomic<int64_t> g_hostfn_spin_ns{[] {
  const char* v = std::getenv("HYBRIDMOE_CPU_HOSTFN_SPIN_US");
  return v ? int64_t(std::atoll(v)) * 1000 : int64_t(0);
}()};

void put(char* buf, int len, const std::string& s) {
  if (buf && len > 0) std::snprintf(buf, size_t(len), "%s", s.c_str());
}

// Waits until the GPU has written a nonzero word to `go` (pinned host memory, written by a stream
// copy queued after the task's input copies), then clears it for the next use. Spins for the
// first millisecond (a decode step's GPU path between layers is ~0.1 ms), then polls every 20 us.
// False after timeout_ns: the GPU never got there (a failed graph launch); the task is skipped.
bool wait_go(volatile int32_t* go, int64_t timeout_ns) {
  const int64_t t0 = now_ns();
  for (int64_t i = 0; !*go; ++i) {
    _mm_pause();
    if ((i & 1023) == 1023) {
      const int64_t el = now_ns() - t0;
      if (el > timeout_ns) return false;
      if (el > 1000000) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);  // the inputs landed before the word did
  *go = 0;
  return true;
}

// How long a gated task waits for its go word (HYBRIDMOE_CPU_GATE_TIMEOUT_S, default 60 s).
const int64_t g_gate_timeout_ns = [] {
  const char* v = std::getenv("HYBRIDMOE_CPU_GATE_TIMEOUT_S");
  const double s = v ? std::atof(v) : 60.0;
  return int64_t((s > 0 ? s : 60.0) * 1e9);
}();

// Queues the task (gated: it starts once *go != 0) and returns its id at once.
int64_t submit_task(Pool* pool, const HmTask& t, int32_t* go) {
  const int64_t t_sub = !go && pool->tracing.load(std::memory_order_relaxed) ? now_ns() : 0;
  const int64_t id = pool->tp.submit([pool, t, go] {
    std::string err;
    const int64_t my_id = pool->tp.completed() + 1;  // tasks run in order
    if (go) {  // for the trace, a gated task counts as submitted when the GPU released it
      if (!wait_go(go, g_gate_timeout_ns)) {
        pool->record("CPU MoE task skipped: the GPU did not release it within HYBRIDMOE_CPU_GATE_TIMEOUT_S");
        return;
      }
      pool->ev(0, my_id);
    }
    pool->ev(1, my_id);
    try {
      err = hm::run_moe_task(pool->tp, *pool->ws, t);
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

}  // namespace

extern "C" {

constexpr int kHostCallRing = 8;

struct HmHostCall {      // userdata of the host-function entry points
  void* pool;
  HmTask task;
  int64_t id;            // the last task submitted with it (<= 0 and no queued id: hm_sync_hostfn uses max_pending)
  int64_t max_pending;
  int32_t status;        // hm_sync_hostfn: 0 ok, 1 the task failed (message kept for hm_sync)
  int32_t pad_;
  // Ids submitted and not yet waited for, oldest first (one producer, one consumer): a gated
  // submit runs on the host thread, ahead of the stream, and the host thread can queue a call's
  // next task (the next forward) before the stream has waited for the previous one.
  int64_t head, tail;
  int64_t ring[kHostCallRing];
};

int hm_abi_version() { return 8; }

}  // extern "C"

namespace {

// Records a submitted id for the call's next wait. If kHostCallRing ids are already waiting (the
// host thread ran that far ahead of the stream), waits for the stream to catch up.
void push_id(HmHostCall* c, int64_t id) {
  const int64_t tail = __atomic_load_n(&c->tail, __ATOMIC_RELAXED);
  while (tail - __atomic_load_n(&c->head, __ATOMIC_ACQUIRE) >= kHostCallRing)
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  c->ring[tail % kHostCallRing] = id;
  c->id = id;
  __atomic_store_n(&c->tail, tail + 1, __ATOMIC_RELEASE);
}

// The id the call's next wait is for: the oldest queued one, else c->id.
int64_t pop_id(HmHostCall* c) {
  const int64_t head = __atomic_load_n(&c->head, __ATOMIC_RELAXED);
  if (head == __atomic_load_n(&c->tail, __ATOMIC_ACQUIRE)) return c->id;
  const int64_t id = c->ring[head % kHostCallRing];
  __atomic_store_n(&c->head, head + 1, __ATOMIC_RELEASE);
  return id;
}

}  // namespace

extern "C" {

void* hm_pool_create(int n, const int* cpus, int nsub, char* err, int errlen) {
  char why[256];
  if (!hm_isa_check(hm::ISA_AVX2, why, sizeof(why))) {
    put(err, errlen, std::string("the CPU engine needs AVX2: ") + why);
    return nullptr;
  }
  try {
    return new Pool(n, cpus, nsub);
  } catch (const std::exception& e) {
    put(err, errlen, e.what());
    return nullptr;
  }
}

void hm_pool_destroy(void* p) { delete static_cast<Pool*>(p); }
int hm_pool_size(void* p) { return static_cast<Pool*>(p)->tp.size(); }
int hm_pool_num_sub(void* p) { return static_cast<Pool*>(p)->tp.num_sub(); }

void* hm_layer_create(const hm::LayerDesc* d, int isa, char* err, int errlen) {
  char why[512];
  if (!hm_isa_check(isa, why, sizeof(why))) {
    put(err, errlen, why);
    return nullptr;
  }
  const hm::Kernels* k = hm::kernels_checked(isa);
  std::string bad;
  if (d->method < hm::M_INT8 || d->method > hm::M_BF16) bad = "unknown method";
  else if (d->method == hm::M_INT4 && d->group != 32 && d->group != 64 && d->group != 128) bad = "int4 group must be 32, 64 or 128";
  else if (d->Hp % 64 || d->Ip % 64 || d->Hp < d->H || d->Ip < d->I || d->H < 1 || d->I < 1 || d->E < 1) bad = "bad padded sizes";
  else if (d->w13.N != 2 * d->Ip || d->w13.Kd != d->Hp || d->w2.N != d->Hp || d->w2.Kd != d->Ip) bad = "matrix shapes disagree with sizes";
  else if (d->method == hm::M_INT4 && (d->Hp % d->group || d->Ip % d->group)) bad = "padded sizes not a multiple of the group";
  else if (!d->w13.data || !d->w2.data || (d->method != hm::M_BF16 && (!d->w13.scale || !d->w2.scale)) ||
           (d->method == hm::M_INT8 && (!d->w13.wsum || !d->w2.wsum)))
    bad = "null weight pointer";
  else if (d->act < hm::ACT_SILU || d->act > hm::ACT_SWIGLU_CLAMP) bad = "unknown activation";
  if (!bad.empty()) {
    put(err, errlen, bad);
    return nullptr;
  }
  return new hm::HmLayer{*d, k, isa, d->method == hm::M_BF16 ? hm::kernels_checked(hm::ISA_AVX2) : nullptr};
}

void hm_layer_destroy(void* l) { delete static_cast<hm::HmLayer*>(l); }
const char* hm_layer_kernel_name(void* l) { return static_cast<hm::HmLayer*>(l)->k->name; }

// Queues the task and returns its id at once. Pointers must stay valid until it completes.
int64_t hm_submit(void* p, const HmTask* task) { return submit_task(static_cast<Pool*>(p), *task, nullptr); }

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

int64_t hm_pending(void* p) {
  Pool* pool = static_cast<Pool*>(p);
  return pool->tp.submitted() - pool->tp.completed();
}

// Copies the phase-time sums (route, quant1, gemm1, quant2, gemm2, reduce, tasks, -) and resets
// them when reset != 0. Read between tasks (not synchronized with a running task).
void hm_profile(double* out8, int reset) {
  for (int i = 0; i < 8; ++i) {
    out8[i] = hm::g_profile[i];
    if (reset) hm::g_profile[i] = 0;
  }
}

int64_t hm_completed(void* p) { return static_cast<Pool*>(p)->tp.completed(); }

// Software prefetch distance of the few-row kernels, in bytes (0: none; negative: 0). Set between
// tasks.
void hm_set_prefetch(int bytes) { hm::g_prefetch_bytes = bytes > 0 ? bytes : 0; }
int hm_get_prefetch() { return hm::g_prefetch_bytes; }

// Weight bytes per GEMM work item of few-row tasks (0: the fixed widths; negative: 0). Set between
// tasks.
void hm_set_item_bytes(int64_t bytes) { hm::g_item_bytes = bytes > 0 ? bytes : 0; }
int64_t hm_get_item_bytes() { return hm::g_item_bytes; }

// Host-function waits: spin this long (us) before sleeping; < 0: the pool's idle spin. Any time.
void hm_set_hostfn_spin_us(int64_t us) { g_hostfn_spin_ns.store(us < 0 ? -1 : us * 1000); }
int64_t hm_get_hostfn_spin_us() {
  int64_t ns = g_hostfn_spin_ns.load();
  return ns < 0 ? -1 : ns / 1000;
}

// GEMM item claiming (0: one item per claim; d > 0: guided, items left / (d * threads) per claim;
// negative: 0). Set between tasks.
void hm_set_guided(int div) { hm::g_guided_div = div > 0 ? div : 0; }
int hm_get_guided() { return hm::g_guided_div; }

// CUDA host-function forms (void fn(void*)), for cuLaunchHostFunc: no Python, no exceptions out.
void hm_submit_hostfn(void* userdata) {
  HmHostCall* c = static_cast<HmHostCall*>(userdata);
  c->status = 0;
  push_id(c, hm_submit(c->pool, &c->task));
}

void hm_sync_hostfn(void* userdata) {
  HmHostCall* c = static_cast<HmHostCall*>(userdata);
  Pool* pool = static_cast<Pool*>(c->pool);
  const int64_t id = pop_id(c);
  pool->ev(3, id);
  const int64_t spin = g_hostfn_spin_ns.load(std::memory_order_relaxed);
  if (id > 0)
    pool->tp.wait_task(id, spin);
  else
    pool->tp.wait_pending(c->max_pending, spin);
  pool->ev(4, id);
  std::lock_guard<std::mutex> lk(pool->em);
  c->status = 0;
  for (auto& e : pool->errors)
    if (e.first == id) c->status = 1;
}

// Gated submits: the task is queued now, from the host thread, and starts once the GPU has written
// a nonzero int32 to `go` (pinned host memory) with a stream copy queued after the input copies.
// The stream then needs no host function to start the CPU side (each one is a trip through the
// driver's callback thread, and blocks the stream until it has run). The id is queued for the
// call's next hm_sync_hostfn. go == nullptr: not gated (a deferred task queued right after a
// gated one).
void hm_submit_gated(HmHostCall* c, int32_t* go) {
  c->status = 0;
  push_id(c, submit_task(static_cast<Pool*>(c->pool), c->task, go));
}

// The gated submits of one captured decode step, in capture order: queued before each replay.
void hm_submit_gated_many(HmHostCall* const* calls, int32_t* const* gos, int n) {
  for (int i = 0; i < n; ++i) hm_submit_gated(calls[i], gos[i]);
}

// Two calls behind one host function (each host function costs the stream a trip through the
// driver's callback thread): a layer's immediate and deferred tasks submitted together, or a
// layer's task waited for together with the previous layer's deferred one.
struct HmHostCallPair {
  HmHostCall* a;
  HmHostCall* b;
};

void hm_submit2_hostfn(void* userdata) {
  HmHostCallPair* p = static_cast<HmHostCallPair*>(userdata);
  hm_submit_hostfn(p->a);
  hm_submit_hostfn(p->b);
}

void hm_sync2_hostfn(void* userdata) {
  HmHostCallPair* p = static_cast<HmHostCallPair*>(userdata);
  hm_sync_hostfn(p->a);
  hm_sync_hostfn(p->b);
}

// Starts recording trace events (up to `capacity`; earlier events are discarded). Call while no
// task runs or is queued.
void hm_trace_start(void* p, int64_t capacity) {
  Pool* pool = static_cast<Pool*>(p);
  pool->tracing.store(false);
  pool->trace.assign(size_t(capacity > 0 ? capacity : 0), TraceEv{0, 0, 0, 0});
  pool->trace_n.store(0);
  pool->tracing.store(true);
}

// Stops recording; copies up to `max` events (4 int64 each: t_ns, id, kind, 0), in the order
// their slots were taken, to out and returns how many were recorded (may exceed max and the
// capacity: the rest were dropped). Call once the traced tasks and host functions are done.
int64_t hm_trace_stop(void* p, int64_t* out, int64_t max) {
  Pool* pool = static_cast<Pool*>(p);
  pool->tracing.store(false);
  int64_t n = pool->trace_n.load();
  int64_t k = std::min<int64_t>({n, max, int64_t(pool->trace.size())});
  for (int64_t i = 0; i < k; ++i) {
    const TraceEv& e = pool->trace[size_t(i)];
    out[4 * i] = e.t_ns;
    out[4 * i + 1] = e.id;
    out[4 * i + 2] = e.kind;
    out[4 * i + 3] = 0;
  }
  return n;
}

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

}  // extern "C"
