// A/B timing of two builds of the direct GGUF kernels (kern.cpp with TAG a = old sources, b = new),
// single thread: results compared bit for bit, then in-cache ns/byte (a few rows resident in L1/L2,
// called over and over) and DRAM-streaming GB/s (rows of a buffer far larger than L3, in 16-row
// N-blocks as gemm() calls them), interleaved a, b, a, b ..., medians; the stream-read ceiling
// (sum of 64-byte loads over the same buffer) measured interleaved too.
//   ab TYPE K MR NROWS REPS MODE(cache|stream) PF [nocheck]
// (nocheck: no bit-for-bit check, for instruction counts of the timed calls under callgrind:
// benchmarks/gguf_ab/callgrind.sh)
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

extern "C" {
void direct_a(int, const uint8_t*, int64_t, int, int, const uint8_t*, int64_t, int, int, float*, int64_t, int);
void direct_b(int, const uint8_t*, int64_t, int, int, const uint8_t*, int64_t, int, int, float*, int64_t, int);
bool quant_a(const float*, int, uint8_t*);
bool quant_b(const float*, int, uint8_t*);
}
using Fn = void (*)(int, const uint8_t*, int64_t, int, int, const uint8_t*, int64_t, int, int, float*, int64_t, int);

static int64_t row_bytes(int type, int K) {
  switch (type) {
    case 2: return K / 32 * 18;
    case 8: return K / 32 * 34;
    case 12: return K / 256 * 144;
    case 13: return K / 256 * 176;
    case 14: return K / 256 * 210;
    case 23: return K / 256 * 136;
  }
  return -1;
}
static void fill(int type, uint8_t* p, int64_t n, std::mt19937& g) {
  for (int64_t i = 0; i < n; ++i) p[i] = uint8_t(g());
  int bs = 0;
  std::vector<int> at;
  switch (type) {
    case 2: bs = 18, at = {0}; break;
    case 8: bs = 34, at = {0}; break;
    case 12: bs = 144, at = {0, 2}; break;
    case 13: bs = 176, at = {0, 2}; break;
    case 14: bs = 210, at = {208}; break;
    case 23: bs = 136, at = {0}; break;
  }
  std::uniform_real_distribution<float> u(1e-3f, 2.1e-2f);
  for (int64_t b = 0; b < n / bs; ++b)
    for (int o : at) {
      const uint16_t h = _cvtss_sh(u(g), 0);
      std::memcpy(p + b * bs + o, &h, 2);
    }
}
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
__attribute__((noinline)) static uint64_t read_stream(const uint8_t* p, int64_t n) {
  __m256i s = _mm256_setzero_si256();
  for (int64_t o = 0; o < n; o += 64)
    s = _mm256_add_epi64(s, _mm256_add_epi64(_mm256_load_si256((const __m256i*)(p + o)),
                                             _mm256_load_si256((const __m256i*)(p + o + 32))));
  return uint64_t(_mm256_extract_epi64(s, 0));
}

int main(int argc, char** argv) {
  if (argc < 8) {
    std::fprintf(stderr, "ab TYPE K MR NROWS REPS cache|stream PF\n");
    return 2;
  }
  const int type = std::atoi(argv[1]), K = std::atoi(argv[2]), mr = std::atoi(argv[3]), nrows = std::atoi(argv[4]);
  const int reps = std::atoi(argv[5]);
  const bool stream = std::strcmp(argv[6], "stream") == 0;
  const int pf = std::atoi(argv[7]);
  const int B = K / 256;
  const int64_t rs = row_bytes(type, K);
  std::mt19937 g(1234);
  // activations: mr rows, each variant its own converted rows
  const int64_t ld = 1 << 16;
  uint8_t* act_a = static_cast<uint8_t*>(std::aligned_alloc(64, ld * 16));
  uint8_t* act_b = static_cast<uint8_t*>(std::aligned_alloc(64, ld * 16));
  std::memset(act_a, 0, ld * 16);
  std::memset(act_b, 0, ld * 16);
  std::normal_distribution<float> nd;
  std::vector<float> x(K);
  for (int t = 0; t < 16; ++t) {
    for (float& v : x) v = nd(g);
    if (!quant_a(x.data(), K, act_a + t * ld) || !quant_b(x.data(), K, act_b + t * ld)) return 3;
  }
  // correctness: 64 rows, every mr 1..mr, bit for bit
  if (argc <= 8 || std::strcmp(argv[8], "nocheck") != 0) {
    const int n = 64;
    std::vector<uint8_t> w(n * rs + 64);
    fill(type, w.data(), n * rs, g);
    std::vector<float> oa(16 * n), ob(16 * n);
    for (int m = 1; m <= mr; ++m) {
      direct_a(type, w.data(), rs, n, B, act_a, ld, K, m, oa.data(), n, 0);
      direct_b(type, w.data(), rs, n, B, act_b, ld, K, m, ob.data(), n, 0);
      double md = 0, mx = 0;
      int neq = 0;
      for (int i = 0; i < m * n; ++i) {
        md = std::max(md, double(std::fabs(oa[i] - ob[i])));
        mx = std::max(mx, double(std::fabs(oa[i])));
        neq += std::memcmp(&oa[i], &ob[i], 4) != 0;
      }
      std::printf("check mr=%d: %d of %d differ in bits, max |a-b| %.3g (max |a| %.3g)\n", m, neq, m * n, md, mx);
    }
  }
  Fn fns[2] = {direct_a, direct_b};
  const uint8_t* acts[2] = {act_a, act_b};
  std::vector<float> out(16 * 64 * 1024);
  if (!stream) {
    std::vector<uint8_t> w(nrows * rs + 64);
    fill(type, w.data(), nrows * rs, g);
    const int inner = std::max(1, int(2e6 / (nrows * rs)));
    std::vector<double> t[2];
    for (int r = 0; r < reps; ++r)
      for (int v = 0; v < 2; ++v) {
        const double t0 = now();
        for (int i = 0; i < inner; ++i) fns[v](type, w.data(), rs, nrows, B, acts[v], ld, K, mr, out.data(), nrows, 0);
        t[v].push_back((now() - t0) / (double(inner) * nrows * rs) * 1e9);
      }
    const double a = median(t[0]), b = median(t[1]);
    std::printf("cache type=%d K=%d mr=%d rows=%d: ns/byte a %.4f b %.4f  b/a %.3f  (GB/s a %.1f b %.1f)\n", type, K, mr,
                nrows, a, b, b / a, 1 / a, 1 / b);
  } else {
    const int64_t total = int64_t(1) << 30;  // 1 GiB of rows
    const int64_t nblk = total / (16 * rs);
    const int64_t nb = nblk * 16 * rs;
    uint8_t* w = static_cast<uint8_t*>(std::aligned_alloc(64, nb + 4096));
    fill(type, w, nb, g);
    std::vector<double> t[3];
    volatile uint64_t sink = 0;
    for (int r = 0; r < reps; ++r)
      for (int v = 0; v < 3; ++v) {
        const double t0 = now();
        if (v == 2) {
          sink = sink + read_stream(w, nb);
        } else {
          for (int64_t k = 0; k < nblk; ++k) {
            const uint8_t* base = w + k * 16 * rs;
            for (int64_t o = 0; o < std::min<int64_t>(pf, 16 * rs); o += 64) _mm_prefetch((const char*)base + o, _MM_HINT_T0);
            fns[v](type, base, rs, 16, B, acts[v], ld, K, mr, out.data() + (k % 1024) * 16, 16 * 1024, pf);
          }
        }
        t[v].push_back(double(nb) / (now() - t0) / 1e9);
      }
    const double a = median(t[0]), b = median(t[1]), c = median(t[2]);
    std::printf("stream type=%d K=%d mr=%d pf=%d: GB/s a %.2f b %.2f read %.2f  ratio a %.3f b %.3f  b/a %.3f\n", type,
                K, mr, pf, a, b, c, a / c, b / c, b / a);
  }
  return 0;
}
