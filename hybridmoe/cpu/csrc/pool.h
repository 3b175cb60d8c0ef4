// The pool behind the C ABI's `void* pool` handles: the thread pool, its settings, its task
// workspace, the errors of failed tasks, and the trace ring. Shared by api.cpp (ABI, pool and
// layer entry points), hostcall.cpp (CUDA host functions and gated submits) and trace.cpp.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "moe.h"
#include "threadpool.h"

extern "C" {
// Settings fixed when a pool is created (mirrored by native.PoolSettings; CPUEngineSettings in
// hybridmoe/cpu/settings.py documents and validates them).
struct HmPoolSettings {
  int64_t prefetch_bytes;  // software prefetch distance of the few-row kernels, bytes (0: none)
  int64_t spin_us;         // idle pool threads spin this long before they sleep
  int64_t hostfn_spin_us;  // host-function waits spin this long before they sleep (-1: spin_us)
  double gate_timeout_s;   // a gated task waits this long for its go word, then is skipped
};
}

namespace hm {

// The accepted ranges (the same as CPUEngineSettings'); "" when s is valid, else what is wrong.
std::string check_settings(const HmPoolSettings& s);

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One trace event: what happened to which task, when (steady clock, ns). Kinds: 0 submitted,
// 1 started, 2 finished, 3 a host function began waiting for it, 4 that wait returned.
struct TraceEv {
  int64_t t_ns;
  int64_t id;
  int32_t kind;
  int32_t pad_;
};

struct Pool {
  HmPoolSettings settings;
  ThreadPool tp;
  Workspace* ws;
  std::mutex em;
  std::deque<std::pair<int64_t, std::string>> errors;
  // Trace ring (off unless hm_trace_start): slots taken with one atomic add, events past the
  // capacity dropped; written by the submitting, the leader and the host-function threads.
  std::vector<TraceEv> trace;
  std::atomic<int64_t> trace_n{0};
  std::atomic<bool> tracing{false};
  // hm_run_task may run a task of an AMX layer on its caller too (hm_pool_inline 2); off by default
  std::atomic<bool> inline_amx{false};
  std::atomic<int> reduce_inline_rows{kReduceInlineRows};  // run_moe_task's (hm_pool_reduce_inline)
  std::atomic<int> fuse{kFuseAll};  // run_moe_task's fuse bits (hm_pool_fuse)
  std::atomic<int> block_prefetch{1};  // run_moe_task's (hm_pool_block_prefetch; towards L2 by default)
  std::atomic<int> items_per_thread{kFewItemsPerThread};  // run_moe_task's (hm_pool_items_per_thread)

  Pool(int n, const int* cpus, int nsub, const HmPoolSettings& s)
      : settings(s), tp(n, cpus, nsub, s.spin_us * 1000), ws(workspace_create(tp.size())) {}
  ~Pool() {
    tp.wait_pending(0);
    workspace_destroy(ws);
  }
  // The task settings now; prefetch_bytes: the distance to use (submit_task takes it at submit time).
  TaskOpts task_opts(int prefetch_bytes) const {
    TaskOpts o;
    o.prefetch_bytes = prefetch_bytes;
    o.reduce_inline_rows = reduce_inline_rows.load(std::memory_order_relaxed);
    o.fuse = fuse.load(std::memory_order_relaxed);
    o.block_prefetch = block_prefetch.load(std::memory_order_relaxed);
    o.items_per_thread = items_per_thread.load(std::memory_order_relaxed);
    return o;
  }
  void ev(int kind, int64_t id, int64_t t = 0) {
    if (!tracing.load(std::memory_order_relaxed)) return;
    int64_t i = trace_n.fetch_add(1, std::memory_order_relaxed);
    if (i < int64_t(trace.size())) trace[size_t(i)] = TraceEv{t ? t : now_ns(), id, kind, 0};
  }
  void record(std::string msg) {
    std::lock_guard<std::mutex> lk(em);
    errors.emplace_back(tp.completed() + 1, std::move(msg));  // tasks run in order: this is our id
  }
  // How long a host function's wait spins before it sleeps, ns (< 0: the pool's idle spin).
  int64_t hostfn_spin_ns() const { return settings.hostfn_spin_us < 0 ? -1 : settings.hostfn_spin_us * 1000; }
};

// Queues the task on the pool and returns its id at once; go != nullptr: gated, it starts once
// *go != 0 (hostcall.cpp); done != nullptr: set to 1 when the task has finished, failed or been skipped
// (a CUDA stream waits on it with a memory operation). Pointers must stay valid until it completes.
int64_t submit_task(Pool* pool, const HmTask& t, int32_t* go, int32_t* done);

// Waits until *go != 0, then clears it; false after timeout_ns (hostcall.cpp).
bool wait_go(volatile int32_t* go, int64_t timeout_ns);

}  // namespace hm
