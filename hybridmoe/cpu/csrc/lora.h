// Expert LoRA on the CPU experts: per (token t, expert e) pair whose token has an adapter slot
// s = lora_idx[t] >= 0 (HmTask.lora_idx), inside the same task as the base expert:
//   g += sc B_g A_g x,  u += sc B_u A_u x   (added to the gate/up GEMM output, before the activation)
//   y += sc B_d A_d h                       (added to the down GEMM output; h = act(g) * u in fp32)
// with sc = scale[s] and rank r = rank[s] <= R. The rank-r products a = sc A v run as their own
// phases (before the gate/up GEMM, and between the activation and the down GEMM); the B products are
// added by each GEMM item to its own columns. Accumulation in fp32; weights bf16 or fp32.
//
// Slot weights (owned by the caller, hybridmoe/cpu/lora_slots.py; zero padded, so a rank-r adapter
// in a rank-R slot and a cleared slot need no reallocation): block (s, e) starts at
// w + (s * E + e) * block elements and holds, in this order,
//   Ag [R][Hp], Au [R][Hp]      A of gate / up (row k: input weights of rank k; columns >= H zero)
//   Bgt [R][Ip], But [R][Ip]    B of gate / up transposed (row k: the outputs of rank k)
//   Ad [R][Ip]                  A of down
//   Bdt [R][Hp]                 B of down transposed
// block = 3 R (Hp + Ip). Transposed Bs let a GEMM item add its 16-column blocks as row AXPYs.
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

class ThreadPool;

// The two kernels, per ISA (lora_avx2.cpp, lora_avx512.cpp); wdt, xdt: DT_F32 or DT_BF16.
struct LoraKernels {
  // out[k] = s * sum_i A[k][i] x[i], k < rows; A row stride lda elements; x holds n values
  void (*dot)(const void* A, int wdt, int64_t lda, int rows, const void* x, int xdt, int n, float s, float* out);
  // for 16-column blocks b < nblk: C[b*cstep + j] += sum_k a[k] Bt[k*ldb + b*bstep + j], j < 16
  void (*axpy)(const void* Bt, int wdt, int64_t ldb, int rows, const float* a, int nblk, int64_t bstep, float* C,
               int64_t cstep);
};

// One task's LoRA state (lora.cpp); null in the driver when no pair of the task has an adapter.
struct LoraTask;

// After routing: the state of a task over S slot rows (slot_tok: token of each row, offs: first row
// of each expert), with the pairs' rank products of x computed (a phase on the pool); nullptr when
// the layer has no LoRA attached, the task no lora_idx, or no row an adapter. Leader thread only;
// the state lives until the next call on this thread.
const LoraTask* lora_begin(ThreadPool& pool, const HmLoraDesc& d, int isa, const int32_t* lora_idx,
                           const void* x, int x_dtype, int H, int64_t T, int64_t S, const int32_t* slot_tok,
                           const int64_t* offs);
// A gate/up item's deltas: rows r0..r0+M of expert e, N-blocks [nb0, nb1) (even: gate, odd: up),
// C[m][(nb - nb0) * 16 + j] (row stride ldc).
void lora_gate_up(const LoraTask& t, int e, int64_t r0, int M, int nb0, int nb1, float* C, int64_t ldc);
// After the activation, before it is quantized: the rank products of h (af [S][Ip]), a phase.
void lora_mid(ThreadPool& pool, const LoraTask& t, const float* af);
// A down item's deltas: rows r0..r0+M of expert e, N-blocks [nb0, nb1), y[m][(nb - nb0) * 16 + j]
// (row stride ldy).
void lora_down(const LoraTask& t, int e, int64_t r0, int M, int nb0, int nb1, float* y, int64_t ldy);

}  // namespace hm

extern "C" const hm::LoraKernels* hm_lora_kernels_avx2() __attribute__((weak));
extern "C" const hm::LoraKernels* hm_lora_kernels_avx512() __attribute__((weak));
