// Few-row expert GEMM kernels by row count: weight bytes/s of FP8 (two builds of moe_avx512.cpp, A
// and B, e.g. the committed kernel and a working copy; B's AMX table too where the CPU has AMX) and
// INT8 (B, AVX-512 VNNI) at 1..8 rows of one expert and the T=16 mix (rows_of_item), interleaved and
// repeated, medians, with 1 or more threads claiming items of 4 N-blocks as the engine does; A and B
// compared bit for bit first (AMX: its max difference from B).
// Built and run by run.sh (see there).
//   cold: the w13 GEMM of DeepSeek-V3 (N 4096, Kd 7168) over `experts` experts (more than the LLC)
//   hot:  4 N-blocks of one expert per thread (458 KB FP8: L2-resident), 64 times: compute cost
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "kernels_avx512.h"  // B's hm::avx512::gemm and fp8_to_bf16

namespace hm {
const Kernels* kernels_checked(int isa);  // dispatch.cpp
}

// A's gemm and fp8_to_bf16 (run.sh appends these to A's source, whose namespace hm is renamed hm_a)
extern "C" void gemm_a(int method, const void* W, int e, const void* A, int M, int nb0, int nb1, float* C,
                       int64_t ldc, int G);
extern "C" void fp8_to_bf16_a(const uint8_t* src, uint16_t* dst, int64_t steps);

namespace {

using Gemm = void (*)(int, const hm::PackedMat&, int, const hm::ActView&, int, int, int, float*, int64_t, int);

void gemm_a_(int method, const hm::PackedMat& W, int e, const hm::ActView& A, int M, int nb0, int nb1, float* C,
             int64_t ldc, int G) {
  gemm_a(method, &W, e, &A, M, nb0, nb1, C, ldc, G);
}

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

struct Setup {
  int N = 4096, Kd = 7168, G = 128, E;
  std::vector<uint8_t> fp8, i8, act16, act8;
  std::vector<float> fsc, isc, asc;
  std::vector<int32_t> wsum;
  hm::PackedMat wf{}, wi{};
  explicit Setup(int experts) : E(experts) {
    std::mt19937 rng(1);
    uint64_t z = 0x9E3779B97F4A7C15ull;  // xorshift for the bulk (GBs of weights)
    const size_t bytes = size_t(E) * N * Kd;
    fp8.resize(bytes);
    i8.resize(bytes);
    for (size_t j = 0; j < bytes; j += 4) {
      z ^= z << 13;
      z ^= z >> 7;
      z ^= z << 17;
      const uint32_t r = uint32_t(z >> 16);
      std::memcpy(&fp8[j], &r, 4);
      std::memcpy(&i8[j], &r, 4);
    }
    for (auto& b : fp8)
      if ((b & 0x7F) == 0x7F) b = 0x3F;  // no NaN codes (the packer refuses them)
    fsc.assign(size_t(E) * (N / 16) * (Kd / G), 0.01f);
    isc.assign(size_t(E) * N, 0.01f);
    wsum.assign(size_t(E) * N, 0);
    act16.resize(size_t(64) * Kd * 2);
    act8.resize(size_t(64) * Kd);
    asc.assign(64, 0.02f);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (size_t j = 0; j < act16.size(); j += 2) {
      float f = u(rng);
      uint32_t v;
      std::memcpy(&v, &f, 4);
      uint16_t h = uint16_t(v >> 16);
      std::memcpy(&act16[j], &h, 2);
    }
    for (auto& b : act8) b = uint8_t(rng());
    wf = {fp8.data(), int64_t(N) * Kd, fsc.data(), nullptr, nullptr, N, Kd};
    wi = {i8.data(), int64_t(N) * Kd, isc.data(), nullptr, wsum.data(), N, Kd};
  }
};

constexpr int kHotReps = 64;

// M = 0: the T=16 DeepSeek-V3 mix (16 tokens x top-8 of 256: an expert's rows ~ Binomial(16, 1/32)
// given >= 1): of 101 items, 80 with 1 row, 18 with 2, 3 with 3, interleaved
int rows_of_item(int M, int64_t it) {
  if (M > 0) return M;
  const int k = int(it % 101);
  return k % 5 == 4 && k < 90 ? 2 : k >= 98 ? 3 : 1;
}

// One pass over the work (cold: every expert's N-blocks; hot: each thread its own 4 blocks of expert
// 0, kHotReps times) by `nth` threads claiming items of 4 N-blocks (the engine's w2 item) from a counter;
// returns weight bytes / s.
double pass(const Setup& s, Gemm g, int method, int M, bool hot, int pf, int nth) {
  const hm::PackedMat& W = method == hm::M_FP8 ? s.wf : s.wi;
  const hm::ActView A{method == hm::M_FP8 ? s.act16.data() : s.act8.data(), method == hm::M_FP8 ? 2 * s.Kd : s.Kd,
                      s.asc.data(), nullptr, 0, pf};
  const int ipe = s.N / 64;  // items per expert
  const int64_t items = hot ? int64_t(kHotReps) * nth : int64_t(s.E) * ipe, ibytes = int64_t(4) * 16 * s.Kd;
  std::atomic<int64_t> next{0};
  std::atomic<int> ready{0};
  auto work = [&](int tid) {
    alignas(64) static thread_local float C[64 * 64];
    ready.fetch_add(1);
    while (ready.load() < nth) std::this_thread::yield();
    for (;;) {
      const int64_t it = hot ? -1 : next.fetch_add(1);
      if (hot) {
        for (int r = 0; r < kHotReps; ++r)
          g(method, W, 0, A, rows_of_item(M, r + tid), 4 * (tid % ipe), 4 * (tid % ipe) + 4, C, 64, s.G);
        return;
      }
      if (it >= items) return;
      const int e = int(it / ipe), nb = int(it % ipe) * 4;
      g(method, W, e, A, rows_of_item(M, it), nb, nb + 4, C, 64, s.G);
    }
  };
  std::vector<std::thread> ts;
  double t0 = now();
  for (int j = 1; j < nth; ++j) ts.emplace_back(work, j);
  work(0);
  for (auto& t : ts) t.join();
  return double(items * ibytes) / (now() - t0) / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  const int experts = argc > 1 ? std::atoi(argv[1]) : 6, rounds = argc > 2 ? std::atoi(argv[2]) : 7;
  const int pf = argc > 3 ? std::atoi(argv[3]) : 2048, nth = argc > 4 ? std::atoi(argv[4]) : 1;
  Setup s(experts);
  const hm::Kernels* amx = hm::kernels_checked(hm::ISA_AMX);  // the AMX table: FP8 from 4 rows on tiles
  const int rowsv[] = {1, 2, 3, 4, 5, 8, 0};  // 0: the T=16 mix (rows_of_item)
  struct K {
    const char* name;
    Gemm g;
    int method;
  };
  std::vector<K> ks = {{"FP8-A", gemm_a_, hm::M_FP8}, {"FP8-B", hm::avx512::gemm, hm::M_FP8}};
  if (amx) ks.push_back({"FP8-Bamx", amx->gemm, hm::M_FP8});
  ks.push_back({"INT8", hm::avx512::gemm, hm::M_INT8});
  const size_t nk = ks.size();
  // bit-exact checks over one expert at every row count: B against A, and each row of B against the
  // same row computed alone (one-row call): does a row's result depend on its expert's row count?
  {  // the AMX path's widening pass (one expert: every byte value many times)
    const int64_t steps = int64_t(s.N / 16) * (s.Kd / 2);
    std::vector<uint16_t> wa(size_t(steps) * 32), wbv(wa.size());
    fp8_to_bf16_a(s.fp8.data(), wa.data(), steps);
    hm::avx512::fp8_to_bf16(s.fp8.data(), wbv.data(), steps);
    std::printf("# fp8_to_bf16: B==A %s\n", wa == wbv ? "yes" : "no");
  }
  std::printf("# rows: B==A, B==B(row alone), A==A(row alone)\n");
  for (int M = 1; M <= 10; ++M) {
    std::vector<float> ca(size_t(10) * 64), cb(ca.size()), c1(ca.size()), d1(ca.size());
    hm::ActView A{s.act16.data(), 2 * s.Kd, s.asc.data(), nullptr, 0, pf};
    bool ab = true, b1 = true, a1 = true;
    for (int nb = 0; nb < s.N / 16; nb += 4) {
      gemm_a_(hm::M_FP8, s.wf, 0, A, M, nb, nb + 4, ca.data(), 64, s.G);
      hm::avx512::gemm(hm::M_FP8, s.wf, 0, A, M, nb, nb + 4, cb.data(), 64, s.G);
      ab = ab && std::memcmp(ca.data(), cb.data(), size_t(M) * 64 * 4) == 0;
      for (int r = 0; r < M; ++r) {
        hm::ActView Ar = A;
        Ar.data += int64_t(r) * A.ld;
        hm::avx512::gemm(hm::M_FP8, s.wf, 0, Ar, 1, nb, nb + 4, c1.data() + r * 64, 64, s.G);
        gemm_a_(hm::M_FP8, s.wf, 0, Ar, 1, nb, nb + 4, d1.data() + r * 64, 64, s.G);
      }
      b1 = b1 && std::memcmp(c1.data(), cb.data(), size_t(M) * 64 * 4) == 0;
      a1 = a1 && std::memcmp(d1.data(), ca.data(), size_t(M) * 64 * 4) == 0;
    }
    std::printf("# %d: %s %s %s", M, ab ? "yes" : "no", b1 ? "yes" : "no", a1 ? "yes" : "no");
    if (amx) {  // the AMX table on the last item: max |amx - B| / max |B|
      std::vector<float> cx(ca.size());
      amx->gemm(hm::M_FP8, s.wf, 0, A, M, s.N / 16 - 4, s.N / 16, cx.data(), 64, s.G);
      double d = 0, m = 0;
      for (size_t j = 0; j < size_t(M) * 64; ++j) {
        d = std::max(d, double(std::fabs(cx[j] - cb[j])));
        m = std::max(m, double(std::fabs(cb[j])));
      }
      std::printf("  amx vs B: %.2e", d / m);
    }
    std::printf("\n");
  }
  std::printf("# experts=%d (%.0f MB FP8), rounds=%d, prefetch=%d, threads=%d\n", experts, double(s.fp8.size()) / 1e6,
              rounds, pf, nth);
  for (int hot = 1; hot >= 0; --hot) {
    std::printf("%s GB/s of weights (median of %d)\n%6s", hot ? "hot (L2)" : "cold (DRAM)", rounds, "rows");
    for (auto& k : ks) std::printf(" %8s", k.name);
    std::printf("   B/A\n");
    for (int M : rowsv) {
      std::vector<std::vector<double>> v(nk);
      for (int r = 0; r < rounds; ++r)
        for (size_t k = 0; k < nk; ++k) v[k].push_back(pass(s, ks[k].g, ks[k].method, M, hot, pf, nth));
      if (M)
        std::printf("%6d", M);
      else
        std::printf("%6s", "mix16");
      std::vector<double> med(nk);
      for (size_t k = 0; k < nk; ++k) {
        std::sort(v[k].begin(), v[k].end());
        med[k] = v[k][v[k].size() / 2];
        std::printf(" %8.2f", med[k]);
      }
      std::printf("   %.3f\n", med[1] / med[0]);
    }
  }
  return 0;
}
