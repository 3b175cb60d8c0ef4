// The C ABI loaded by hybridmoe/cpu/native.py through ctypes. Tensors cross as raw pointers and
// shapes; nothing here depends on torch. Compiled for baseline x86-64: every entry point that could
// reach AVX2 code first checks the CPU (dispatch.cpp), so a missing ISA is an error, never SIGILL.
// Errors inside a task are caught, recorded with the task id, and returned by hm_sync.
#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
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

struct HmHostCall;  // defined in the extern "C" block below

namespace {

// A doorbell: the stream-memory-operation form of the host functions (see hm_doorbell_add).
struct Bell {
  HmHostCall* call;
  std::atomic<uint32_t>* go;
  std::atomic<uint32_t>* done;
};

struct Pool {
  hm::ThreadPool tp;
  hm::Workspace* ws;
  std::mutex em;
  std::deque<std::pair<int64_t, std::string>> errors;
  // doorbells: the watcher reads an immutable snapshot; hm_doorbell_add/clear publish a new one
  std::mutex bm;
  std::shared_ptr<const std::vector<Bell>> bells = std::make_shared<const std::vector<Bell>>();
  std::thread watcher;
  std::atomic<bool> wstop{false};
  std::atomic<uint64_t> wgen{0};  // watcher loop count: hm_doorbell_clear waits for it to move on
  Pool(int n, const int* cpus, int nsub) : tp(n, cpus, nsub), ws(hm::workspace_create(tp.size())) {}
  ~Pool() {
    wstop.store(true);
    if (watcher.joinable()) watcher.join();
    tp.wait_pending(0);
    hm::workspace_destroy(ws);
  }
  std::shared_ptr<const std::vector<Bell>> snapshot() {
    std::lock_guard<std::mutex> lk(bm);
    return bells;
  }
  void watch();
  void record(std::string msg) {
    std::lock_guard<std::mutex> lk(em);
    errors.emplace_back(tp.completed() + 1, std::move(msg));  // tasks run in order: this is our id
  }
};

// Runs a task body as hm_submit does; returns the error message ("" when it ran).
std::string run_guarded(Pool* pool, const HmTask& t) {
  try {
    return hm::run_moe_task(pool->tp, *pool->ws, t);
  } catch (const std::exception& e) {
    return std::string("CPU MoE task failed: ") + e.what();
  } catch (...) {
    return "CPU MoE task failed (unknown exception)";
  }
}

void put(char* buf, int len, const std::string& s) {
  if (buf && len > 0) std::snprintf(buf, size_t(len), "%s", s.c_str());
}

}  // namespace

extern "C" {

struct HmHostCall {      // userdata of the host-function entry points
  void* pool;
  HmTask task;
  int64_t id;            // set by hm_submit_hostfn; hm_sync_hostfn waits for it (<= 0: use max_pending)
  int64_t max_pending;
  int32_t status;        // hm_sync_hostfn: 0 ok, 1 the task failed (message kept for hm_sync)
  int32_t pad_;
};

int hm_abi_version() { return 2; }

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
  return new hm::HmLayer{*d, k, isa};
}

void hm_layer_destroy(void* l) { delete static_cast<hm::HmLayer*>(l); }
const char* hm_layer_kernel_name(void* l) { return static_cast<hm::HmLayer*>(l)->k->name; }

// Queues the task and returns its id at once. Pointers must stay valid until it completes.
int64_t hm_submit(void* p, const HmTask* task) {
  Pool* pool = static_cast<Pool*>(p);
  HmTask t = *task;
  return pool->tp.submit([pool, t] {
    std::string err = run_guarded(pool, t);
    if (!err.empty()) pool->record(err);
  });
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

// CUDA host-function forms (void fn(void*)), for cuLaunchHostFunc: no Python, no exceptions out.
void hm_submit_hostfn(void* userdata) {
  HmHostCall* c = static_cast<HmHostCall*>(userdata);
  c->status = 0;
  c->id = hm_submit(c->pool, &c->task);
}

void hm_sync_hostfn(void* userdata) {
  HmHostCall* c = static_cast<HmHostCall*>(userdata);
  Pool* pool = static_cast<Pool*>(c->pool);
  if (c->id > 0)
    pool->tp.wait_task(c->id);
  else
    pool->tp.wait_pending(c->max_pending);
  std::lock_guard<std::mutex> lk(pool->em);
  c->status = 0;
  for (auto& e : pool->errors)
    if (e.first == c->id) c->status = 1;
}

// Doorbells, the form of the host functions for CUDA stream memory operations: the stream writes 1
// into a call's `go` word (cuStreamWriteValue32); the pool's watcher thread, which polls the words
// of the registered calls, clears it and queues the call's task; when that has run (or failed:
// status 1, message kept for hm_sync) it writes 1 into `done`, which the stream waits for
// (cuStreamWaitValue32) and then clears. Both words live in page-locked host memory the GPU can
// write; no driver callback thread is on the path. The watcher spins while calls keep coming and
// backs off to short sleeps after HYBRIDMOE_CPU_SPIN_US (default 1000) without one.
int hm_doorbell_add(void* p, HmHostCall* call, uint32_t* go, uint32_t* done) {
  Pool* pool = static_cast<Pool*>(p);
  if (!call || !go || !done) return 1;
  std::lock_guard<std::mutex> lk(pool->bm);
  auto next = std::make_shared<std::vector<Bell>>(*pool->bells);
  next->push_back(Bell{call, reinterpret_cast<std::atomic<uint32_t>*>(go), reinterpret_cast<std::atomic<uint32_t>*>(done)});
  pool->bells = next;
  if (!pool->watcher.joinable()) pool->watcher = std::thread([pool] { pool->watch(); });
  return 0;
}

// Forgets every doorbell. On return the watcher no longer reads their words (it has started a scan
// of the new, empty list), so their memory may be freed once the pool has no task pending.
void hm_doorbell_clear(void* p) {
  Pool* pool = static_cast<Pool*>(p);
  uint64_t g;
  {
    std::lock_guard<std::mutex> lk(pool->bm);
    pool->bells = std::make_shared<const std::vector<Bell>>();
    g = pool->wgen.load();
  }
  if (!pool->watcher.joinable()) return;
  while (pool->wgen.load() < g + 2) std::this_thread::sleep_for(std::chrono::microseconds(10));
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

namespace {
void Pool::watch() {
  const char* env = std::getenv("HYBRIDMOE_CPU_SPIN_US");
  const auto spin = std::chrono::microseconds(env ? std::atoll(env) : 1000);
  auto last = std::chrono::steady_clock::now();
  int idle = 0;
  while (!wstop.load(std::memory_order_relaxed)) {
    wgen.fetch_add(1);
    auto snap = snapshot();
    bool rang = false;
    for (const Bell& b : *snap) {
      if (b.go->load(std::memory_order_acquire) == 0) continue;
      b.go->store(0, std::memory_order_relaxed);
      rang = true;
      HmHostCall* c = b.call;
      std::atomic<uint32_t>* done = b.done;
      Pool* self = this;
      c->id = tp.submit([self, c, done] {
        std::string err = run_guarded(self, c->task);
        c->status = err.empty() ? 0 : 1;
        if (!err.empty()) self->record(err);
        done->store(1, std::memory_order_release);  // last: the stream may reuse the buffers now
      });
    }
    if (rang) {
      last = std::chrono::steady_clock::now();
      idle = 0;
    } else if (++idle % 64 == 0 && std::chrono::steady_clock::now() - last > spin) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    } else {
      _mm_pause();
    }
  }
}
}  // namespace
