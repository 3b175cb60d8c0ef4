// Shared types of the CPU expert engine. Plain C++17; no torch headers.
//
// Legend: T tokens, K top-k, E experts, H hidden, I intermediate, S slots (token, expert) pairs,
// N output rows of a matrix, Kd reduction (inner) size. "p" suffix = padded.
//
// Packed weight layout (produced by hybridmoe/cpu/quant.py, read here), per expert, per matrix:
//   rows are grouped in blocks of 16 (an "N-block"); inside a block the reduction dimension is
//   cut into 4-byte "steps": step s holds, for each of the 16 rows, 4 bytes (int8: 4 K values,
//   bf16: 2 K values, int4: see below). One step = 64 bytes = one AVX-512 register = one row of
//   an AMX B tile. Block nb of expert e starts at  data + e*expert_stride + nb*block_bytes.
//   int8 : [N/16][Kd/4][16][4] int8, scale[E][N] f32, wsum[E][N] i32 (row sums, for u8*s8 dots)
//   int4 : [N/16][Kd/8][64 bytes]; byte j of 64-byte unit u holds int8-layout element j of
//          step 2u in its low nibble and of step 2u+1 in its high nibble; nibbles are unsigned
//          q in [0,15], w = d*q + m; d,m [E][N/16][Kd/G][16] f32 (m absent when symmetric: m=-8d)
//   bf16 : [N/16][Kd/2][16][2] bf16
//   fp8  : [N/16][Kd/4][64] float8_e4m3fn bytes: a 64-byte line holds two bf16-layout steps (32 values:
//          [16 rows][2]) lane-interleaved, byte 16L + 8p + i = value 8L + i of step p (so AVX-512
//          byte unpacks widen it to the two bf16 steps in order); scale [E][N/16][Kd/G] f32 (G = the
//          checkpoint's block K), w = fp8 * scale; NaN bytes are refused at packing
// w13 (gate_up) rows are interleaved per 16: block 2j = gate rows 16j.., block 2j+1 = up rows 16j..
#pragma once
#include <cstddef>
#include <cstdint>

namespace hm {

enum Method : int { M_INT8 = 0, M_INT4 = 1, M_BF16 = 2, M_FP8 = 3 };
enum Isa : int { ISA_AVX2 = 0, ISA_AVX512 = 1, ISA_AMX = 2 };
enum Act : int { ACT_SILU = 0, ACT_GELU_TANH = 1, ACT_SWIGLU_CLAMP = 2 };
enum DType : int { DT_F32 = 0, DT_BF16 = 1 };

struct PackedMat {
  const uint8_t* data;     // packed weights, all experts
  int64_t expert_stride;   // bytes per expert
  const float* scale;      // int8: [E][N]; int4: d [E][N/16][Kd/G][16]; fp8: [E][N/16][Kd/G]
  const float* zero;       // int4 asymmetric: m, same shape as d; else nullptr
  const int32_t* wsum;     // int8: [E][N] sum of the row's int8 values
  int N, Kd;               // padded sizes (N % 64 == 0, Kd % 64 == 0 and % G == 0)
};

struct LayerDesc {
  int method, E, H, I, Hp, Ip, group, act;
  float act_alpha, act_limit;  // clamped SwiGLU parameters
  PackedMat w13;  // N = 2*Ip, Kd = Hp
  PackedMat w2;   // N = Hp,   Kd = Ip
};

// Quantized / converted activations of consecutive rows (one expert's slots).
struct ActView {
  const uint8_t* data;  // row r at data + r*ld
  int64_t ld;           // bytes per row
  const float* scale;   // [rows] (int methods)
  const int32_t* gsum;  // [rows][Kd/G] (int4)
  int gstride;          // Kd/G
  // Software prefetch distance of the few-row (decode) kernels, bytes ahead of the weight stream
  // (0: none): the pool's setting (CPUEngineSettings.prefetch_bytes), passed with every GEMM call.
  // The AMX tile kernels use it too, per weight block of a pair, on their first pass over the pair.
  int prefetch;
  // The GGUF direct kernels' second prefetch (hm_pool_block_prefetch): 0 none; 1 / 2: while row r of an
  // item's N-block is computed, row r of the item's next N-block is requested towards L2 (1, the pool's
  // default) or L1 (2). A longer lead than `prefetch`: one core read its GGUF rows from DRAM at ~0.6 of its
  // stream rate with `prefetch` alone (the same rows from L3: faster than that stream), so the misses it
  // keeps in flight bound it (session 29: 1 thread +11% Q4_K / +24% Q8_0, 15 threads +2-15%).
  int block_prefetch = 0;
};

// The per-ISA kernel table. A method a table cannot run has gemm == nullptr.
struct Kernels {
  const char* name;
  // bytes of one converted activation row of padded width Kdp for the method
  int64_t (*act_row_bytes)(int method, int Kdp);
  // convert one row: src (dtype) of K real values -> dst row (zero padded to Kdp).
  // Returns false when the row holds NaN or Inf.
  bool (*quant_row)(int method, const void* src, int src_dtype, int K, int Kdp, int group, uint8_t* dst,
                    float* scale, int32_t* gsum);
  // C[m][n - nb0*16] (row stride ldc floats) = sum_k a[m][k] * w[e][n][k], dequantized, for
  // m in [0, M), n in [nb0*16, nb1*16). nb1 - nb0 is even.
  void (*gemm)(int method, const PackedMat& W, int e, const ActView& A, int M, int nb0, int nb1, float* C,
               int64_t ldc, int group);
  // Optional (nullptr: absent): convert fp32 values [256 blk, 256 blk + 256) of a row of Kd values
  // into their part of the dst row, written by no other block's call, so the blocks of one row
  // may be converted by different threads in any order, each once its 256 values are final (the
  // GGUF tables: the driver then converts the expert activation inside the gate/up phase).
  // Returns false when the block holds NaN or Inf.
  bool (*quant_block)(const float* src, int Kd, int blk, uint8_t* dst);
};

inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

}  // namespace hm

// Defined in the ISA translation units (weak: a unit the compiler could not build is absent).
extern "C" const hm::Kernels* hm_kernels_avx2() __attribute__((weak));
extern "C" const hm::Kernels* hm_kernels_avx512() __attribute__((weak));
extern "C" const hm::Kernels* hm_kernels_amx() __attribute__((weak));
extern "C" const hm::Kernels* hm_kernels_amx_emu() __attribute__((weak));  // moe_amx_emu.cpp
