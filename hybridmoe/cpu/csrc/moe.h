// One MoE layer task on the pool: routing, activation quantization, the two expert GEMMs,
// and the weighted reduction into the output. Compiled with -mavx2 -mfma -mf16c; callers must
// have checked the CPU (dispatch.cpp) before constructing anything from this unit.
#pragma once
#include <atomic>
#include <cstdint>
#include <string>

#include "common.h"
#include "lora.h"
#include "threadpool.h"

extern "C" {
// The task as it crosses the C ABI (mirrored by a ctypes Structure in native.py).
struct HmTask {
  void* layer;             // HmLayer*
  const void* x;           // [T, H] x_dtype
  const void* ids;         // [T, K] int32 (ids_dtype 0) or int64 (1); negative id = no expert
  const float* weights;    // [T, K]
  const uint8_t* skip;     // [E] nonzero = skip this expert; may be null
  void* out;               // [T, H] out_dtype
  int64_t T;
  int32_t K, x_dtype, ids_dtype, out_dtype, accumulate;
  // A token whose own values are non-finite (its input row, a routing weight, an expert activation):
  // 0 fails the task, naming the token ("... at token N": the CPU device fails that token's request and
  // runs the step again); 1 writes NaN over the token's output row and goes on (the CUDA path, whose
  // task errors surface a step late: the NaN reaches the token's logits and the sampler fails that
  // request alone, engine/sampler.py NAN_ROW).
  int32_t nan_rows;
  const int32_t* lora_idx;  // [T] adapter slot of each token (-1: none); may be null (lora.h)
  // A second group of pairs with an output of its own, run in the same task after the first (a layer's
  // deferred pairs, behind its immediate ones: one task instead of two, without the second's start and
  // the first's tail): ids2 [T, K] (ids_dtype; -1 = not in this group; weights from `weights`), out2
  // [T, H] (out_dtype). done1: an int32 set to 1 (release) once `out` is written, while the second group
  // may still run (a CUDA stream waits on it); also set when the task fails. All null: one group.
  const void* ids2;
  void* out2;
  int32_t* done1;
};
}

namespace hm {

struct HmLayer {
  LayerDesc d;
  const Kernels* k;
  int isa;
  const Kernels* k_fp32act;  // BF16: the kernels that keep fp32 activations (AVX2); else nullptr
  HmLoraDesc lora{};         // expert LoRA slot weights (hm_layer_attach_lora); w == nullptr: none
};

struct Workspace;  // scratch buffers, one per pool (tasks run one at a time)
Workspace* workspace_create(int nthreads);
void workspace_destroy(Workspace*);

// The default of reduce_inline_rows (below): a decode-sized sum of up to this many rows of H runs on
// the leader alone.
constexpr int kReduceInlineRows = 16;

// run_moe_task's fuse bits. kFuseReduce: a one-token task does its weighted sum inside the w2 phase
// (each output chunk by the thread that completes it), whatever reduce_inline_rows says. kFuseQuant: a
// task whose experts have at most kFuseQuantRows rows each converts each expert's activation rows
// inside the w13 phase (by the thread that completes the expert's last item), not in a phase of its own.
// kFuseChain (kFuseQuant's tasks, and GGUF tasks of as few rows an expert, without LoRA): the w2 items
// run in the w13 phase too, each after its expert's rows are converted, without the barrier between.
constexpr int kFuseReduce = 1, kFuseQuant = 2, kFuseChain = 4, kFuseAll = 7;
constexpr int kFuseQuantRows = 16;

// The default of TaskOpts::items_per_thread: few-row (decode) items are sized for about this many a thread.
constexpr int kFewItemsPerThread = 8;

// A task's run settings (the pool's, read when the task runs; benchmarks switch them between tasks).
struct TaskOpts {
  int prefetch_bytes = 0;  // the few-row kernels' software prefetch distance (0: none)
  int reduce_inline_rows = kReduceInlineRows;  // the weighted sum runs on the leader alone up to T * K rows
  int fuse = kFuseAll;  // light phases folded into the GEMM phases (kFuse* bits)
  int block_prefetch = 0;  // ActView::block_prefetch
  int items_per_thread = kFewItemsPerThread;  // few_row_cw's target of items a thread (1..64)
  // set (relaxed) once the task has published HmTask.done1: the submitter's every-way-out mark then leaves
  // the word alone, since a stream may have waited for it and cleared it already (a second 1 would let the
  // stream's next wait on that word pass before the next task's output is written)
  std::atomic<bool>* done1_set = nullptr;
};

// Runs the task with the pool's threads (call on the leader thread). Returns "" or an error text.
std::string run_moe_task(ThreadPool& pool, Workspace& ws, const HmTask& task, const TaskOpts& opts);

// Stream-read bandwidth of `bytes` with all pool threads (leader thread), GB/s.
double stream_read(ThreadPool& pool, int64_t bytes, int iters);

}  // namespace hm
