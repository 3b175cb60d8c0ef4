// Expert LoRA on the CPU experts: per (token t, expert e) pair whose token has an adapter slot
// s = lora_idx[t] >= 0 (HmTask.lora_idx), inside the same task as the base expert:
//   g += sc B_g A_g x,  u += sc B_u A_u x   (added to the gate/up GEMM output, before the activation)
//   y += sc B_d A_d h                       (added to the down GEMM output; h = act(g) * u in fp32)
// with sc = scale[s] and rank r = rank[s] <= R. No phase of its own: the rank-r products a = sc A v
// are cut into units (a run of rows of one (expert, slot) x up to LORA_UNIT_RANKS ranks) that sit at
// the head of the GEMM stage's item queues (the A of gate/up with the gate/up items, the A of down
// with the down items); a GEMM item adds the B products to its own columns once its expert's units
// of that stage are done. Accumulation in fp32; weights bf16 or fp32.
//
// Slot weights (owned by the caller, hybridmoe/cpu/lora_slots.py; zero padded, so a rank-r adapter
// in a rank-R slot and a cleared slot need no reallocation): block (s, e) starts at
// w + (s * E + e) * block elements and holds, in this order,
//   Ag [R][Hp], Au [R][Hp]      A of gate / up (row k: input weights of rank k; columns >= H zero)
//   Bg [Ip/16][R][16], Bu       B of gate / up transposed and cut in 16-column blocks: block j, row k
//                               holds the outputs 16j .. 16j+15 of rank k
//   Ad [R][Ip]                  A of down
//   Bd [Hp/16][R][16]           B of down, blocked as Bg
// block = 3 R (Hp + Ip). A GEMM item (a few 16-column blocks) reads its Bs' R x 16 blocks whole and
// contiguous.
#pragma once
#include <cstdint>

extern "C" {
struct HmLoraDesc {       // mirrored by hybridmoe/cpu/lora_slots.py LoraDesc
  const void* w;          // slot weights (layout above), wdtype
  const float* scale;     // [slots] alpha / r (0: an empty slot)
  const int32_t* rank;    // [slots] rank in use (0: an empty slot)
  int64_t block;          // elements per (slot, expert) block = 3 R (Hp + Ip)
  int32_t slots, R, E, Hp, Ip, wdtype;  // wdtype: 0 fp32, 1 bf16 (DType)
};
}

namespace hm {

// The two kernels, per ISA (lora_avx2.cpp, lora_avx512.cpp); wdt, xdt: DT_F32 or DT_BF16. Both take
// up to LORA_ROWS rows of one (expert, slot): the rows share every weight load, and their
// accumulators are independent FMA chains (prefill rows of one request come in such runs).
constexpr int LORA_ROWS = 4;
struct LoraKernels {
  // out[m * ldo + k] = s * sum_i A[k][i] x[m][i], m < M, k < rows; A row stride lda; x[m] holds n values
  void (*dot)(const void* A, int wdt, int64_t lda, int rows, const void* const* x, int xdt, int M, int n, float s,
              float* out, int64_t ldo);
  // for m < M and 16-column blocks b < nblk:
  //   C[m * ldc + b * cstep + j] += sum_k a[m * lda + k] Bt[k * ldb + b * bstep + j], j < 16
  void (*axpy)(const void* Bt, int wdt, int64_t ldb, int rows, const float* a, int64_t lda, int M, int nblk,
               int64_t bstep, float* C, int64_t ldc, int64_t cstep);
};

// Ranks per rank-product unit: a unit of one row reads 4 A rows (16 KB of bf16 at H = 2048).
constexpr int LORA_UNIT_RANKS = 4;

// One task's LoRA state (lora.cpp); null in the driver when no pair of the task has an adapter.
struct LoraTask;

// At the start of a task of a layer with LoRA slots attached (leader thread): prefetches the state
// lora_begin will read, so its cache misses overlap the routing and activation work before it.
void lora_warm(const HmLoraDesc& d, const int32_t* lora_idx, int64_t T);
// After routing: the state of a task over S slot rows (slot_tok: token of each row, offs: first row
// of each expert) and its units; nullptr when the layer has no LoRA attached, the task no lora_idx,
// or no row an adapter. Leader thread only; the state lives until the next call on this thread.
const LoraTask* lora_begin(const HmLoraDesc& d, int isa, const int32_t* lora_idx, const void* x, int x_dtype, int H,
                           int64_t T, int64_t S, const int32_t* slot_tok, const int64_t* offs);
// The units of a GEMM stage (0: gate/up, 1: down), and unit u's work (any thread; waits for nothing).
int64_t lora_units(const LoraTask& t, int stage);
void lora_unit(const LoraTask& t, int stage, int64_t u);
// A gate/up item's deltas: rows r0..r0+M of expert e, N-blocks [nb0, nb1) (even: gate, odd: up),
// C[m][(nb - nb0) * 16 + j] (row stride ldc). Waits for e's stage-0 units.
void lora_gate_up(const LoraTask& t, int e, int64_t r0, int M, int nb0, int nb1, float* C, int64_t ldc);
// Before a GEMM item's own GEMM (stage 0: gate/up, 1: down; its arguments as in lora_gate_up and
// lora_down): prefetches the B ranges the item's deltas will read, so their cold lines arrive while
// the GEMM runs (read after it, each item's few hundred bytes .. 2 KB per B cost a memory latency).
void lora_prefetch(const LoraTask& t, int stage, int e, int64_t r0, int M, int nb0, int nb1);
// Between the stages (leader): the activations af [S][Ip] the stage-1 units read (fp32, before
// they are quantized for the down GEMM).
void lora_mid(const LoraTask& t, const float* af);
// A down item's deltas: rows r0..r0+M of expert e, N-blocks [nb0, nb1), y[m][(nb - nb0) * 16 + j]
// (row stride ldy). Waits for e's stage-1 units.
void lora_down(const LoraTask& t, int e, int64_t r0, int M, int nb0, int nb1, float* y, int64_t ldy);

}  // namespace hm

extern "C" const hm::LoraKernels* hm_lora_kernels_avx2() __attribute__((weak));
extern "C" const hm::LoraKernels* hm_lora_kernels_avx512() __attribute__((weak));
