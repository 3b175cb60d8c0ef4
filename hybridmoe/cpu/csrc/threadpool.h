// The library's thread pool: `n` threads pinned to given CPUs, split into `nsub` sub-pools (one per
// NUMA node). Thread 0 is the leader: it takes tasks from an in-order queue and runs them; inside a
// task it calls parallel() to run a phase on all threads (itself included), with a barrier at the end
// (or, for a dynamic phase, a wait for the threads that joined it).
// Idle threads spin for spin_ns (CPUEngineSettings.spin_us) and then sleep.
// A synchronous caller (the CPU-only model path) may instead run work itself in the leader's place
// (run_inline): no hand-off to the leader and no wake-up of the waiting caller, and the caller's core
// is the leader's (which sleeps when nothing is queued), so the pool never runs one thread too many.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace hm {

class ThreadPool {
 public:
  using PhaseFn = void (*)(int tid, void* ctx);

  ThreadPool(int n, const int* cpus, int nsub, int64_t spin_ns);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_; }
  const std::vector<int>& cpus() const { return cpus_; }  // CPU of each thread (-1: not pinned)
  int num_sub() const { return nsub_; }
  int sub_of(int tid) const { return int(int64_t(tid) * nsub_ / n_); }
  int sub_begin(int s) const { return int((int64_t(s) * n_ + nsub_ - 1) / nsub_); }
  int sub_size(int s) const { return sub_begin(s + 1) - sub_begin(s); }

  // Runs fn(tid, ctx) on all threads and returns when all finished. Leader thread only.
  // dynamic: fn takes its work from a shared counter until none is left, so once this thread's fn
  // returns every piece is taken; threads that have not joined the phase by then skip it instead of
  // being waited for. A pool thread that lost its core (another process, the hypervisor) between
  // phases then holds up no phase it had no part in; only the piece it holds is waited for.
  void parallel(PhaseFn fn, void* ctx, bool dynamic = false);

  // Runs fn(ctx) on the calling thread in the leader's place (fn may call parallel(), whose phases
  // then use the other threads and this one as thread 0) if no task is queued or running and no
  // other inline call runs; returns false, fn not run, otherwise (the caller queues it instead).
  // fn must not throw.
  bool run_inline(void (*fn)(void*), void* ctx);
  // Off: run_inline always returns false (benchmarks compare the queued path in one process).
  void set_inline(bool on) { inline_on_.store(on); }
  bool inline_on() const { return inline_on_.load(); }
  // How long the leader thread spins for the next task after its queue ran empty before it sleeps
  // (ns; < 0: the pool's idle spin). 0 frees the leader's core at once for a caller that leads inline
  // phases in its place (the CPU-only path): a spinning leader time-shares that core with it.
  void set_leader_spin(int64_t ns) { leader_spin_ns_.store(ns); }
  // Off: every phase waits for every thread, dynamic or not (benchmarks compare both in one process).
  void set_dynamic(bool on) { dynamic_on_.store(on); }
  bool dynamic_on() const { return dynamic_on_.load(); }
  int64_t leader_spin() const { return leader_spin_ns_.load(); }

  // Task queue (any thread). Tasks run in submission order; ids start at 1.
  int64_t submit(std::function<void()> task);
  // Until task `id` has finished / at most max_pending tasks are queued or running. The caller
  // spins for spin_ns (< 0: the pool's idle spin) and then sleeps.
  void wait_task(int64_t id, int64_t spin_ns = -1);
  void wait_pending(int64_t max_pending, int64_t spin_ns = -1);
  int64_t submitted() const { return submitted_.load(); }
  int64_t completed() const { return completed_.load(); }

 private:
  void worker(int tid);
  void leader_loop();
  void run_phase_worker(int tid, uint64_t& seen);
  bool spin_until(const std::function<bool()>& ready, int64_t spin_ns = -1) const;

  int n_, nsub_;
  int64_t spin_ns_;
  std::vector<std::thread> threads_;
  std::vector<int> cpus_;
  // phases
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> remaining_{0};  // workers yet to run a (non-dynamic) phase
  std::atomic<int> active_{0};     // workers inside the open phase's fn (or checking whether it is open)
  std::atomic<uint64_t> open_{0};  // the generation of the phase workers may join; 0: closed
  bool dynamic_ = false;
  std::atomic<int> sleepers_{0};
  PhaseFn job_ = nullptr;
  void* ctx_ = nullptr;
  std::mutex pm_;
  std::condition_variable pcv_;
  // tasks
  std::mutex qm_;
  std::condition_variable qcv_, dcv_;
  std::deque<std::function<void()>> queue_;
  std::atomic<int64_t> submitted_{0}, completed_{0};
  std::atomic<int> task_waiters_{0}, done_waiters_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> inline_on_{true};
  std::atomic<int64_t> leader_spin_ns_{-1};
  std::atomic<bool> dynamic_on_{true};
  std::mutex lead_mu_;  // held while parallel() may be called: a queued task on the leader, or run_inline
};

}  // namespace hm
