// Plain softmax top-k routing on the CPU (the Qwen3-MoE / Mixtral router): logits [T][E] (fp32 or
// bf16) -> weights [T][K] fp32 and expert ids [T][K] int32, optionally renormalized to sum 1. The
// native twin of hybridmoe/layers/fused_ops.py topk_softmax_ref (torch.softmax of logits.float(),
// torch.topk, weights / sum) for the CPU-only path: fused_ops.topk_softmax calls it for CPU tensors,
// and hm_layer_decode runs it between the router GEMV and the layer's MoE task, so both paths route
// identically.
//
// Which ids, in which order: the selection runs torch.topk's own CPU algorithm (ATen TopKImpl.h:
// for K*64 <= E a K-element heap of (value, index) pairs fed in index order, then sort_heap; else
// nth_element + sort of the first K-1) with its comparator, through the same standard-library calls,
// on the logits instead of the probabilities. Softmax is monotone, so every comparison gives what
// torch's gives, ties included (equal logits are equal probabilities, and the same algorithm breaks
// the tie the same way), except where torch's float probabilities of two *different* logits round to
// the same value (logits within ~1 ulp of |logit - max|, or probabilities that underflow to 0): torch
// then sees a tie we do not, and may pick the other, equally valid, expert. A row whose max is not
// finite (a NaN or +inf logit, or all -inf) is all-NaN in torch: every key is then NaN (every
// comparison false, as in torch) and every weight NaN.
//
// Weights: exp(logit - max), the sums and the division in double, one rounding to fp32 at the end: within
// an ulp of the float64 softmax of the same logits. torch's own roundings (a float logit - max, its
// vectorized exp, a float sum, x * (1/sum)) put it several fp32 ulps away from that, more for small weights
// and large E (tests/cpu/test_route_cpu.py states the bounds).
//
// Plain C++ built for baseline x86-64: fused_ops calls it with no pool and no ISA check behind it,
// and the work (E exps and a K-heap a row) is too small for vector code to matter.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace {

using Elem = std::pair<float, int64_t>;  // (key, expert): torch's elem_t for float

// torch.topk's "largest" comparator: NaN above everything, else greater.
struct Greater {
  bool operator()(const Elem& x, const Elem& y) const {
    return (std::isnan(x.first) && !std::isnan(y.first)) || (x.first > y.first);
  }
};

inline float bf16_f32(uint16_t v) {
  const uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The first K of torch.topk(key[0:E], K, largest=True, sorted=True) into q[0:K).
void topk_sorted(const float* key, int64_t E, int64_t K, std::vector<Elem>& q) {
  const Greater comp;
  q.resize(size_t(E));
  for (int64_t j = 0; j < E; ++j) q[size_t(j)] = Elem(key[j], j);
  if (K * 64 <= E) {
    std::partial_sort(q.begin(), q.begin() + K, q.end(), comp);
  } else {
    std::nth_element(q.begin(), q.begin() + (K - 1), q.end(), comp);
    std::sort(q.begin(), q.begin() + (K - 1), comp);
  }
}

}  // namespace

extern "C" {

// logits: [T][ld] elements of dtype (0 fp32, 1 bf16), E <= ld experts; K in [1, E]; renorm != 0:
// weights divided by their sum. w: fp32 [T][K], ids: int32 [T][K], sorted by weight, largest
// first. Returns 0, or 1 for bad sizes (nothing written).
int hm_topk_softmax(const void* logits, int32_t dtype, int64_t T, int64_t E, int64_t ld, int32_t K, int32_t renorm,
                    float* w, int32_t* ids) {
  if (T < 0 || E < 1 || ld < E || K < 1 || K > E || (dtype != 0 && dtype != 1) || E > (int64_t(1) << 30)) return 1;
  if (T == 0) return 0;
  if (!logits || !w || !ids) return 1;
  thread_local std::vector<float> v;  // the row in fp32, then (an all-NaN row) its keys
  thread_local std::vector<Elem> q;
  v.resize(size_t(E));
  for (int64_t t = 0; t < T; ++t) {
    if (dtype == 1) {
      const uint16_t* row = static_cast<const uint16_t*>(logits) + t * ld;
      for (int64_t j = 0; j < E; ++j) v[size_t(j)] = bf16_f32(row[j]);
    } else {
      std::memcpy(v.data(), static_cast<const float*>(logits) + t * ld, size_t(E) * 4);
    }
    float m = -std::numeric_limits<float>::infinity();
    bool nan = false;
    for (int64_t j = 0; j < E; ++j) {
      nan |= std::isnan(v[size_t(j)]);
      m = std::max(m, v[size_t(j)]);
    }
    float* wr = w + t * K;
    int32_t* ir = ids + t * K;
    if (nan || !std::isfinite(m)) {  // torch: every probability NaN, so every key ties
      std::fill(v.begin(), v.end(), std::numeric_limits<float>::quiet_NaN());
      topk_sorted(v.data(), E, K, q);
      for (int32_t k = 0; k < K; ++k) {
        wr[k] = std::numeric_limits<float>::quiet_NaN();
        ir[k] = int32_t(q[size_t(k)].second);
      }
      continue;
    }
    topk_sorted(v.data(), E, K, q);
    // in double from the fp32 logits on: an fp32 logit - max (|x| up to ~50) rounds by up to |x| * 2^-25, which
    // exp turns into that relative error: 11 ulps at E = 1000 (scale-4 logits), more than the rest together
    const double md = m;
    double sum = 0.0;  // of every expert's exp: the softmax denominator
    for (int64_t j = 0; j < E; ++j) sum += std::exp(double(v[size_t(j)]) - md);
    double top = 0.0;
    for (int32_t k = 0; k < K; ++k) top += std::exp(double(q[size_t(k)].first) - md);
    const double den = renorm ? top : sum;
    for (int32_t k = 0; k < K; ++k) {
      wr[k] = float(std::exp(double(q[size_t(k)].first) - md) / den);
      ir[k] = int32_t(q[size_t(k)].second);
    }
  }
  return 0;
}

}  // extern "C"
