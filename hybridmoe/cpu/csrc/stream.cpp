// Stream-read bandwidth probe run by the library's own pool: the ceiling the decode kernels are
// compared with (benchmarks/bench_cpu_moe.py). Baseline unit; the read loop is AVX2 (checked first).
// gcc 12 headers warn (falsely) about _mm512 helpers that use undefined values
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "moe.h"

extern "C" int hm_isa_check(int isa, char* msg, int len);

namespace hm {

namespace {
inline void range_of(int64_t n, int tid, int nth, int64_t& b, int64_t& e) {
  b = n * tid / nth;
  e = n * (tid + 1) / nth;
}
}  // namespace

// ---- stream-read bandwidth -------------------------------------------------------------------
namespace {
struct StreamCtx {
  ThreadPool* pool;
  const uint8_t* buf;
  uint8_t* wbuf;
  int64_t bytes;
  std::atomic<int64_t> sink{0};
};
void ph_stream_fill(int tid, void* p) {
  StreamCtx& c = *static_cast<StreamCtx*>(p);
  int64_t b, e;
  range_of(c.bytes / 4096, tid, c.pool->size(), b, e);
  std::memset(c.wbuf + b * 4096, tid + 1, size_t(e - b) * 4096);
}
__attribute__((target("avx2"))) void ph_stream_read(int tid, void* p) {
  StreamCtx& c = *static_cast<StreamCtx*>(p);
  int64_t b, e;
  range_of(c.bytes / 128, tid, c.pool->size(), b, e);
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = b; i < e; ++i) {
    const __m256i* q = reinterpret_cast<const __m256i*>(c.buf + i * 128);
    a0 = _mm256_add_epi32(a0, _mm256_load_si256(q));
    a1 = _mm256_add_epi32(a1, _mm256_load_si256(q + 1));
    a2 = _mm256_add_epi32(a2, _mm256_load_si256(q + 2));
    a3 = _mm256_add_epi32(a3, _mm256_load_si256(q + 3));
  }
  __m256i s = _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3));
  c.sink.fetch_add(_mm256_extract_epi32(s, 0) + _mm256_extract_epi32(s, 7), std::memory_order_relaxed);
}
}  // namespace

// The same with 64-byte loads, 512 bytes per iteration (the width the AVX-512/AMX kernels read at).
__attribute__((target("avx512f"))) void ph_stream_read512(int tid, void* p) {
  StreamCtx& c = *static_cast<StreamCtx*>(p);
  int64_t b, e;
  range_of(c.bytes / 512, tid, c.pool->size(), b, e);
  __m512i a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm512_setzero_si512();
  for (int64_t i = b; i < e; ++i) {
    const uint8_t* q = c.buf + i * 512;
    for (int j = 0; j < 8; ++j) a[j] = _mm512_add_epi32(a[j], _mm512_load_si512(q + 64 * j));
  }
  for (int j = 1; j < 8; ++j) a[0] = _mm512_add_epi32(a[0], a[j]);
  c.sink.fetch_add(_mm512_reduce_add_epi32(a[0]), std::memory_order_relaxed);
}

double stream_read(ThreadPool& pool, int64_t bytes, int iters) {
  // On 2 MB pages where the kernel gives them (MADV_HUGEPAGE before the first touch), like the weights
  // (hybridmoe/cpu/hugepages.py): the ceiling is the best stream the machine reads, not a 4 KB-page one.
  constexpr int64_t kHuge = int64_t(2) << 20;
  bytes = round_up(std::max<int64_t>(bytes, 1 << 20), kHuge);
  uint8_t* buf = static_cast<uint8_t*>(std::aligned_alloc(size_t(kHuge), size_t(bytes)));
  if (!buf) return 0.0;
  madvise(buf, size_t(bytes), MADV_HUGEPAGE);  // a refusal leaves 4 KB pages
  StreamCtx c;
  c.pool = &pool;
  c.buf = buf;
  c.wbuf = buf;
  c.bytes = bytes;
  pool.parallel(ph_stream_fill, &c);  // first touch by the reading threads
  const bool wide = hm_isa_check(ISA_AVX512, nullptr, 0) != 0;
  double best = 1e30;
  for (int it = 0; it < std::max(1, iters); ++it) {
    auto t0 = std::chrono::steady_clock::now();
    pool.parallel(wide ? ph_stream_read512 : ph_stream_read, &c);
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, dt);
  }
  std::free(buf);
  return double(bytes) / best / 1e9;
}

}  // namespace hm
