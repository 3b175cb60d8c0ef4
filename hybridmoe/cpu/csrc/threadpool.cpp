#include "threadpool.h"

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <chrono>

namespace hm {

namespace {
constexpr int64_t kYieldAfterNs = 20000;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
void pin_to(int cpu) {
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort
}
}  // namespace

ThreadPool::ThreadPool(int n, const int* cpus, int nsub, int64_t spin_ns)
    : n_(n < 1 ? 1 : n), nsub_(nsub < 1 ? 1 : nsub), spin_ns_(spin_ns < 0 ? 0 : spin_ns) {
  if (nsub_ > n_) nsub_ = n_;
  cpus_.assign(n_, -1);
  if (cpus)
    for (int i = 0; i < n_; ++i) cpus_[i] = cpus[i];
  threads_.reserve(n_);
  threads_.emplace_back([this] { leader_loop(); });
  for (int t = 1; t < n_; ++t) threads_.emplace_back([this, t] { worker(t); });
}

ThreadPool::~ThreadPool() {
  wait_pending(0);
  {
    std::lock_guard<std::mutex> lk(qm_);
    stop_.store(true);
  }
  qcv_.notify_all();
  {
    std::lock_guard<std::mutex> lk(pm_);
    gen_.fetch_add(1);
  }
  pcv_.notify_all();
  for (auto& t : threads_) t.join();
}

bool ThreadPool::spin_until(const std::function<bool()>& ready, int64_t spin_ns) const {
  if (spin_ns < 0) spin_ns = spin_ns_;
  int64_t t0 = now_ns();
  for (int i = 0;; ++i) {
    if (ready()) return true;
    if (spin_ns == 0) return false;
    _mm_pause();
    if ((i & 255) == 255) {
      int64_t el = now_ns() - t0;
      if (el > spin_ns) return false;
      if (el > kYieldAfterNs) std::this_thread::yield();  // let a descheduled peer run (oversubscribed CPU)
    }
  }
}

void ThreadPool::run_phase_worker(int tid, uint64_t& seen) {
  auto ready = [&] { return gen_.load(std::memory_order_acquire) != seen; };
  if (!spin_until(ready)) {
    std::unique_lock<std::mutex> lk(pm_);
    sleepers_.fetch_add(1);
    pcv_.wait(lk, ready);
    sleepers_.fetch_sub(1);
  }
  const uint64_t g = gen_.load(std::memory_order_acquire);
  seen = g;
  if (stop_.load()) return;
  // Join phase g unless the leader closed it already (a dynamic phase whose work is all taken; we
  // woke late). seq_cst on both sides (Dekker): either the leader's wait sees us active, or we see
  // the phase closed. While we are active the leader leaves job_, ctx_ and dynamic_ as they are.
  active_.fetch_add(1, std::memory_order_seq_cst);
  if (open_.load(std::memory_order_seq_cst) == g) {
    job_(tid, ctx_);
    if (!dynamic_) remaining_.fetch_sub(1, std::memory_order_acq_rel);
  }
  active_.fetch_sub(1, std::memory_order_release);
}

void ThreadPool::worker(int tid) {
  pin_to(cpus_[tid]);
  uint64_t seen = 0;
  while (!stop_.load()) run_phase_worker(tid, seen);
}

namespace {
// Spins until cond() (acquire loads inside), yielding after a while: a late worker then gets the
// core if it shares ours.
template <class Cond>
void await(Cond cond) {
  int64_t t0 = 0;
  for (int i = 0; !cond(); ++i) {
    _mm_pause();
    if ((i & 255) == 255) {
      if (!t0) t0 = now_ns();
      else if (now_ns() - t0 > kYieldAfterNs) std::this_thread::yield();
    }
  }
}
}  // namespace

void ThreadPool::parallel(PhaseFn fn, void* ctx, bool dynamic) {
  if (n_ == 1) {
    fn(0, ctx);
    return;
  }
  // no worker is active here: the last phase was closed and drained
  dynamic = dynamic && dynamic_on_.load(std::memory_order_relaxed);
  job_ = fn;
  ctx_ = ctx;
  dynamic_ = dynamic;
  remaining_.store(n_ - 1, std::memory_order_relaxed);
  const uint64_t g = gen_.load(std::memory_order_relaxed) + 1;
  open_.store(g, std::memory_order_relaxed);
  gen_.store(g);  // seq_cst: publishes the above; pairs with the sleepers_ increment in run_phase_worker
  if (sleepers_.load() > 0) {
    std::lock_guard<std::mutex> lk(pm_);
    pcv_.notify_all();
  }
  fn(0, ctx);
  if (!dynamic) await([&] { return remaining_.load(std::memory_order_acquire) == 0; });
  open_.store(0, std::memory_order_seq_cst);  // late workers skip it from here on
  await([&] { return active_.load(std::memory_order_seq_cst) == 0; });
}

int64_t ThreadPool::submit(std::function<void()> task) {
  int64_t id;
  {
    std::lock_guard<std::mutex> lk(qm_);
    queue_.push_back(std::move(task));
    id = submitted_.fetch_add(1) + 1;
  }
  if (task_waiters_.load() > 0) qcv_.notify_one();
  return id;
}

void ThreadPool::leader_loop() {
  pin_to(cpus_[0]);
  for (;;) {
    std::function<void()> task;
    auto ready = [&] { return completed_.load() < submitted_.load() || stop_.load(); };
    if (!spin_until(ready, leader_spin_ns_.load(std::memory_order_relaxed))) {
      std::unique_lock<std::mutex> lk(qm_);
      task_waiters_.fetch_add(1);
      qcv_.wait(lk, ready);
      task_waiters_.fetch_sub(1);
    }
    {
      std::lock_guard<std::mutex> lk(qm_);
      if (queue_.empty()) {
        if (stop_.load()) return;
        continue;
      }
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    {
      std::lock_guard<std::mutex> lead(lead_mu_);  // an inline call may be running: after it
      task();  // must not throw (the api wraps tasks)
    }
    completed_.fetch_add(1);
    if (done_waiters_.load() > 0) {
      std::lock_guard<std::mutex> lk(qm_);
      dcv_.notify_all();
    }
  }
}

bool ThreadPool::run_inline(void (*fn)(void*), void* ctx) {
  if (!inline_on_.load(std::memory_order_relaxed)) return false;
  std::unique_lock<std::mutex> lead(lead_mu_, std::try_to_lock);
  if (!lead.owns_lock() || completed_.load() != submitted_.load()) return false;  // queued work runs first
  fn(ctx);
  return true;
}

void ThreadPool::wait_task(int64_t id, int64_t spin_ns) {
  auto ready = [&] { return completed_.load() >= id; };
  if (spin_until(ready, spin_ns)) return;
  std::unique_lock<std::mutex> lk(qm_);
  done_waiters_.fetch_add(1);
  dcv_.wait(lk, ready);
  done_waiters_.fetch_sub(1);
}

void ThreadPool::wait_pending(int64_t max_pending, int64_t spin_ns) {
  if (max_pending < 0) max_pending = 0;
  wait_task(submitted_.load() - max_pending, spin_ns);
}

}  // namespace hm
