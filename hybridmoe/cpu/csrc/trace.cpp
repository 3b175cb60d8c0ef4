// The pool's trace of task events (submitted, started, finished, waited for by a host function),
// read by hybridmoe/cpu/trace.py. Recording is off unless started; see Pool::ev in pool.h.
#include <algorithm>
#include <cstdint>

#include "pool.h"

using hm::Pool;
using hm::TraceEv;

extern "C" {

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

}  // extern "C"
