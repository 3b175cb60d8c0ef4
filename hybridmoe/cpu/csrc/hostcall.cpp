// CUDA host functions (void fn(void*), for cuLaunchHostFunc: no Python, no exceptions out) that
// wait for CPU tasks, and gated submits: a task queued from the host thread ahead of the stream
// that starts once the GPU has written a nonzero int32 to its `go` word (pinned host memory) with
// a stream copy queued after the task's input copies. The stream then needs no host function to
// start the CPU side (each one is a trip through the driver's callback thread, and blocks the
// stream until it has run); only the waits are host functions.
#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>

#include "moe.h"
#include "pool.h"

using hm::Pool;

extern "C" {

constexpr int kHostCallRing = 8;

struct HmHostCall {      // userdata of the host functions (mirrored by native.HostCall)
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
  // Pinned int32 the pool sets to 1 when a task submitted with this call is done (nullptr: none). With
  // it the stream waits with cuStreamWaitValue32 and resets it with cuStreamWriteValue32 (no host
  // function, no trip through the driver's callback thread); its ids are then not queued for
  // hm_sync_hostfn, which such a call must not be given.
  int32_t* done;
};

}  // extern "C"

namespace hm {

// Spins for the first millisecond (a decode step's GPU path between layers is ~0.1 ms), then
// polls every 20 us. False after timeout_ns: the GPU never got there (a failed graph launch).
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

}  // namespace hm

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

// Host function: blocks the stream until the call's oldest submitted task is done (spinning for
// the pool's hostfn_spin_us first); status 1 when that task failed.
void hm_sync_hostfn(void* userdata) {
  HmHostCall* c = static_cast<HmHostCall*>(userdata);
  Pool* pool = static_cast<Pool*>(c->pool);
  const int64_t id = pop_id(c);
  pool->ev(3, id);
  const int64_t spin = pool->hostfn_spin_ns();
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

// Queues the call's task now (from the host thread), started once *go != 0; go == nullptr: not
// gated (a deferred task queued right after a gated one). The id is queued for the call's next
// hm_sync_hostfn (a call with a done word: the task sets it instead).
void hm_submit_gated(HmHostCall* c, int32_t* go) {
  c->status = 0;
  const int64_t id = hm::submit_task(static_cast<Pool*>(c->pool), c->task, go, c->done);
  if (c->done)
    c->id = id;
  else
    push_id(c, id);
}

// The gated submits of one captured decode step, in capture order: queued before each replay.
void hm_submit_gated_many(HmHostCall* const* calls, int32_t* const* gos, int n) {
  for (int i = 0; i < n; ++i) hm_submit_gated(calls[i], gos[i]);
}

// Two waits behind one host function (each host function costs the stream a trip through the
// driver's callback thread): a layer's task waited for together with the previous layer's
// deferred one.
struct HmHostCallPair {
  HmHostCall* a;
  HmHostCall* b;
};

void hm_sync2_hostfn(void* userdata) {
  HmHostCallPair* p = static_cast<HmHostCallPair*>(userdata);
  hm_sync_hostfn(p->a);
  hm_sync_hostfn(p->b);
}

}  // extern "C"
