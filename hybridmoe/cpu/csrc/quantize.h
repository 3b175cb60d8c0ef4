// Load-time quantization of routed experts into the kernels' packed layouts (hybridmoe/cpu/quant.py
// holds the torch reference; the results are bit-identical to it). One call packs one stacked matrix
// [E, N, K] (gate_up interleaved into "w13" when w13_inter > 0) on all threads of a pool.
// Legend: E experts, N source rows, K source columns, Np/Kp padded sizes, G int4 group size.
#pragma once
#include <cstdint>
#include <string>

extern "C" {
// The source: a strided stack of float matrices, or (data == nullptr) random values drawn in place
// (uniform in [-a, a] with a = std * sqrt(3); one counter-based stream per (seed, expert, row), so
// the result does not depend on the thread count).
struct HmQuantSrc {
  const void* data;       // [E][N][K] at the strides below, or nullptr: random
  int32_t dtype;          // 0 f32, 1 bf16, 2 f16
  int32_t E, N, K;
  int64_t expert_stride;  // elements
  int64_t row_stride;     // elements
  int32_t w13_inter;      // > 0: N == 2 * w13_inter rows of gate then up, packed interleaved as w13
  int32_t pad_;
  uint64_t seed;          // random source only
  double std;             // random source only
};

// The destination (quant.py PackedMatrix): data [E][bytes], int8: scale [E][Np] f32, wsum [E][Np]
// i32; int4: scale (d) and zero (m, asymmetric only) [E][Np/16][Kp/G][16] f32; bf16: data only.
struct HmQuantDst {
  void* data;
  float* scale;
  float* zero;
  int32_t* wsum;
  int32_t Np, Kp;
  int32_t method;  // 0 AMXINT8, 1 AMXINT4, 2 BF16 (quant.py METHODS)
  int32_t group;
  int32_t symmetric;
  int32_t pad_;
};
}

namespace hm {
class ThreadPool;
// "" on success, else what is wrong with the arguments. Runs on the calling thread (a pool task).
const char* quantize_check(const HmQuantSrc& s, const HmQuantDst& d);
// "" on success, else the first source row found holding a NaN or an infinity (its expert and row;
// the rest of the work is skipped, the destination left partly written).
std::string quantize_run(ThreadPool& pool, const HmQuantSrc& s, const HmQuantDst& d);
}  // namespace hm
