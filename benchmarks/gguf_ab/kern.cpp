// One build of the direct GGUF kernels (the csrc directory on the include path), exported under the
// suffix TAG so that two builds (old and new sources) can be timed side by side in one process
// (benchmarks/ab_gguf_direct.py). ISA512 = 1: the AVX-512 unit's kernels (gguf_dot512.h), 0: AVX2.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

#include "gguf_common.h"

#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)

namespace hm {
namespace {
constexpr bool kVnni = ISA512;
constexpr int MR = ISA512 ? 8 : 4;
#include "gguf_unpack.h"
#if ISA512
#include "gguf_dot512.h"
#else
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#include "gguf_dot256.h"
#endif
}  // namespace
}  // namespace hm

extern "C" void CAT(direct_, TAG)(int type, const uint8_t* w, int64_t rs, int nrows, int B, const uint8_t* act,
                                  int64_t ld, int K, int mr, float* out, int64_t ldc, int pf) {
  hm::ActView A{};
  A.data = act;
  A.ld = ld;
  hm::direct_rows(type, w, rs, nrows, B, A, K, 0, mr, out, ldc, pf);
}
extern "C" bool CAT(quant_, TAG)(const float* x, int K, uint8_t* dst) { return hm::quant_act_row(x, hm::DT_F32, K, dst); }
