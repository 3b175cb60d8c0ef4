"""Triton kernels and host-side launch code for the fused (grouped) MoE expert computation.

Legend: T tokens, H hidden size, I expert intermediate size, E experts of the layer, K top-k,
P = T*K (token, slot) pairs, S = padded slots (static worst case, a multiple of BM), B = S // BM blocks,
BM / BN / BK block sizes along the pair (M), output (N) and reduction (K) dimensions.

Pipeline, with no host synchronization (every shape depends only on T, K, E and the config, so the
whole forward can be captured in a CUDA graph for a fixed T):
  1. `align_pairs`: group the P pairs by expert (stable), pad each expert's group to a multiple of BM
     in a buffer of S = P + min(E, P) * (BM - 1) slots (rounded up to BM); unused slots hold the
     sentinel P. Each BM-block gets its expert id, or E for a block past the last used one (those
     programs exit at once). Decode (P <= 512): one single-program Triton kernel; else ~20 torch ops.
  2. `_gate_up_kernel`: for each (block, N-tile of I): x[token(pair)] @ gate_up[e]^T for the gate rows
     and the up rows, silu(gate) * up fused in the epilogue -> inter[pair, I].
  3. `_down_kernel`: inter[pair] @ down[e]^T times the pair's routing weight -> out_pairs[pair, H].
  4. `_sum_pairs_kernel`: out[t] = sum over the K pairs of t, accumulated in fp32 (deterministic; no atomics).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from hybridmoe import envs


@dataclass(frozen=True)
class MoEKernelConfig:
    """Tile sizes for one forward. `block_m` is shared by both kernels (it is the alignment unit)."""

    block_m: int = 16
    gu_block_n: int = 32  # N tile over I in the gate/up kernel (gate and up each get this many rows)
    gu_block_k: int = 128  # reduction tile over H
    gu_warps: int = 4
    gu_stages: int = 4
    dn_block_n: int = 64  # N tile over H in the down kernel
    dn_block_k: int = 128  # reduction tile over I
    dn_warps: int = 4
    dn_stages: int = 4
    group_m: int = 8  # blocks of M visited together for L2 reuse of weight tiles (prefill)


def default_config(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int) -> MoEKernelConfig:
    """Config heuristic by T (through the average number of pairs per expert, T*K/E).

    Decode (few pairs per expert): BM=16 and narrow N tiles so that even T=1 (K experts touched)
    launches several hundred programs, each streaming a slice of one expert's weights once.
    Prefill: larger BM/BN so each weight tile is reused across many rows (compute-bound regime).
    """
    per_expert = num_tokens * top_k / max(num_experts, 1)
    if per_expert <= 16:  # decode and small batches: memory-bound
        narrow = num_tokens * top_k <= 16  # only a handful of experts touched: split N finer
        return MoEKernelConfig(
            block_m=16,
            gu_block_n=16 if narrow else 32,
            gu_block_k=128,
            dn_block_n=32 if narrow else 64,
            dn_block_k=128,
            gu_warps=4,
            dn_warps=4,
            gu_stages=4,
            dn_stages=4,
        )
    if per_expert <= 48:
        return MoEKernelConfig(block_m=32, gu_block_n=64, gu_block_k=64, dn_block_n=64, dn_block_k=64,
                               gu_warps=4, dn_warps=4, gu_stages=4, dn_stages=4)
    if per_expert <= 192:
        return MoEKernelConfig(block_m=64, gu_block_n=64, gu_block_k=64, dn_block_n=128, dn_block_k=64,
                               gu_warps=4, dn_warps=4, gu_stages=4, dn_stages=4)
    return MoEKernelConfig(block_m=128, gu_block_n=64, gu_block_k=64, dn_block_n=128, dn_block_k=64,
                           gu_warps=8, dn_warps=8, gu_stages=3, dn_stages=3)


CONFIG_DIR_ENV = envs.MOE_CONFIG_DIR  # (a development variable: hybridmoe/envs.py)


def config_file(num_experts: int, hidden: int, inter: int, top_k: int) -> Path:
    """Where tuned configs for one layer shape live (benchmarks/sweep_moe_decode.py writes them)."""
    root = envs.moe_config_dir() or Path(__file__).with_name("configs")
    return root / f"E{num_experts}_H{hidden}_I{inter}_K{top_k}.json"


@functools.lru_cache(maxsize=64)
def _tuned_table(path: Path) -> dict[int, MoEKernelConfig]:
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    return {int(t): MoEKernelConfig(**c) for t, c in raw.get("configs", {}).items()}


def tuned_config(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int) -> MoEKernelConfig | None:
    """The measured-best config for this shape at the smallest tuned T >= num_tokens (None: no
    table for this shape, or T beyond its largest entry)."""
    table = _tuned_table(config_file(num_experts, hidden, inter, top_k))
    fits = [t for t in table if t >= num_tokens]
    return table[min(fits)] if fits else None


def choose_config(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int) -> MoEKernelConfig:
    """A tuned config when one was measured for this shape, else the heuristic."""
    return (tuned_config(num_tokens, num_experts, top_k, hidden, inter)
            or default_config(num_tokens, num_experts, top_k, hidden, inter))


ALIGN_TRITON_MAX_PAIRS = 256  # one-program align up to here, the three-kernel grid above. bench_align.py on the
# H100 host (session 25, E=128, block_m 64), us a call eager / in a graph:
#   P=128:  triton 62 / 11.4, grid 118 / 11.4, torch 424 / 46
#   P=512:  triton 74 / 28.9, grid 117 / 13.7, torch 364 / 69
#   P=1024: triton 95 / 50.8, grid  89 / 14.0, torch 293 / 73
#   P=65536: triton 3018 / 2960, grid 149 / 101, torch 355 / 130
# (256 lies between the measured sizes: not timed itself). The torch path stays the reference. In an eager
# 128-token prefill of Qwen3-30B-A3B (P = 1024) grid against torch took the prefill from 77.6 to 56.1 ms
# (medians of 3, interleaved; profile_decode.py --prefill 128 --align-ab), with the same first tokens.
ALIGN_LARGE_DEFAULT = "grid"  # HYBRIDMOE_ALIGN_LARGE=torch for A/B runs
ALIGN_GRID_MAX_PROGRAMS = 64  # programs of the grid align's count and scatter kernels (a power of two)


def padded_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """S: at most min(E, P) experts are touched, each wasting at most BM-1 slots; a multiple of BM."""
    cap = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(cap, block_m) * block_m


def align_pairs(
    topk_ids: torch.Tensor,  # [T, K] int
    num_experts: int,
    block_m: int,
    method: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the (token, slot) pairs by expert, each group padded to a multiple of `block_m`.

    Returns (sorted_pairs [S] int32: pair index t*K + j, or the sentinel P in padding slots;
    block_expert [B] int32: expert of each block, E for unused blocks). Pairs of one expert keep
    their order (stable). Shapes are fixed by (T, K, E, block_m): no host sync, CUDA-graph capturable.
    method: "triton" (one program; decode), "grid" (three kernels over up to 64 programs; prefill),
    "torch" (sort-based, ~20 ops; the reference), or "auto" (triton up to ALIGN_TRITON_MAX_PAIRS, then grid).
    """
    num_pairs = topk_ids.numel()
    if method == "auto":
        method = "triton" if num_pairs <= ALIGN_TRITON_MAX_PAIRS else envs.align_large(ALIGN_LARGE_DEFAULT)
    if method == "torch":
        return _align_pairs_torch(topk_ids, num_experts, block_m)
    if method == "grid":
        return _align_pairs_grid(topk_ids, num_experts, block_m)
    if method != "triton":
        raise ValueError(f"align method must be auto, triton, grid or torch, got {method!r}")
    cap = padded_capacity(num_pairs, num_experts, block_m)
    ids = topk_ids.reshape(-1)
    sorted_pairs = torch.empty(cap, dtype=torch.int32, device=ids.device)  # [S]
    block_expert = torch.empty(cap // block_m, dtype=torch.int32, device=ids.device)  # [B]
    e_pow2 = triton.next_power_of_2(num_experts)
    chunk = max(16, min(1024, 8192 // e_pow2))
    _align_kernel[(1,)](ids, sorted_pairs, block_expert, num_pairs, num_experts, cap,
                        cap // block_m, BLOCK_M=block_m, E_POW2=e_pow2, CHUNK=chunk, num_warps=8)
    return sorted_pairs, block_expert


@triton.jit
def _align_kernel(
    ids_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, num_experts, cap, num_blocks,
    BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr,
):
    """One program: counts per expert (one-hot sums), padded offsets (cumsum), padding fill,
    block experts, then each pair's slot = its group's start + its rank (one-hot cumsum; stable)."""
    offs_e = tl.arange(0, E_POW2)
    counts = tl.zeros((E_POW2,), dtype=tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [Ep]
    pad_end = tl.cumsum(padded, axis=0)  # [Ep]
    pad_start = pad_end - padded
    real_e = offs_e < num_experts
    for s0 in range(0, cap, CHUNK):
        offs = s0 + tl.arange(0, CHUNK)
        tl.store(sorted_pairs_ptr + offs, tl.zeros((CHUNK,), dtype=tl.int32) + num_pairs, mask=offs < cap)
    for b0 in range(0, num_blocks, CHUNK):  # expert of a block: number of groups ending at or before it
        blk = b0 + tl.arange(0, CHUNK)
        be = tl.sum(((pad_end[None, :] <= (blk * BLOCK_M)[:, None]) & real_e[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blk, be, mask=blk < num_blocks)
    tl.debug_barrier()  # the padding fill above is ordered before the pair stores below
    running = pad_start
    # the loop of _scatter_chunk, written out: this kernel runs in every decode step's graph and stays as it
    # was checked on the GPU until the helper has run there (test_gpu_align_triton_matches_torch)
    for c0 in range(0, num_pairs, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        onehot = (ids[:, None] == offs_e[None, :]).to(tl.int32)  # [C, Ep]
        rank = tl.cumsum(onehot, axis=0) - 1 + running[None, :]
        dest = tl.sum(onehot * rank, axis=1)  # [C]
        tl.store(sorted_pairs_ptr + dest, offs, mask=offs < num_pairs)
        running += tl.sum(onehot, axis=0)


@triton.jit
def _scatter_chunk(ids_ptr, sorted_pairs_ptr, c0, num_pairs, running, offs_e, CHUNK: tl.constexpr):
    """Pairs [c0, c0 + CHUNK) to their slots: running[e] (expert e's next free slot) + their rank among the
    chunk's pairs of e (one-hot cumsum: stable); returns running past them."""
    offs = c0 + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
    onehot = (ids[:, None] == offs_e[None, :]).to(tl.int32)  # [C, Ep]
    rank = tl.cumsum(onehot, axis=0) - 1 + running[None, :]
    dest = tl.sum(onehot * rank, axis=1)  # [C]
    tl.store(sorted_pairs_ptr + dest, offs, mask=offs < num_pairs)
    return running + tl.sum(onehot, axis=0)


def _align_pairs_grid(
    topk_ids: torch.Tensor,  # [T, K] int
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_pairs` in three launches at any size: per-span expert counts (NP programs), the prefix
    over spans and experts with the padding and block experts (one program), each pair's slot (NP)."""
    num_pairs = topk_ids.numel()
    dev = topk_ids.device
    cap = padded_capacity(num_pairs, num_experts, block_m)
    ids = topk_ids.reshape(-1)
    e_pow2 = triton.next_power_of_2(num_experts)
    chunk = max(16, min(1024, 8192 // e_pow2))  # one-hot [chunk, Ep] per step, as the one-program kernel
    max_programs = max(1, min(ALIGN_GRID_MAX_PROGRAMS, 16384 // e_pow2))  # the scan's table [NP, Ep]
    programs = max(1, min(max_programs, triton.cdiv(num_pairs, chunk)))
    span = max(1, triton.cdiv(triton.cdiv(num_pairs, programs), chunk)) * chunk  # pairs a program: whole chunks
    programs = max(1, triton.cdiv(num_pairs, span))
    np_pow2 = triton.next_power_of_2(programs)
    table = torch.empty(np_pow2, e_pow2, dtype=torch.int32, device=dev)  # [NP, Ep] counts, then offsets
    sorted_pairs = torch.empty(cap, dtype=torch.int32, device=dev)  # [S]
    block_expert = torch.empty(cap // block_m, dtype=torch.int32, device=dev)  # [B]
    # fmt: off
    _align_count_kernel[(programs,)](ids, table, num_pairs, span, E_POW2=e_pow2, CHUNK=chunk, num_warps=4)
    _align_scan_kernel[(1,)](table, sorted_pairs, block_expert, programs, num_pairs, num_experts, cap, cap // block_m,
                             BLOCK_M=block_m, NP_POW2=np_pow2, E_POW2=e_pow2, CHUNK=chunk, num_warps=8)
    _align_scatter_kernel[(programs,)](ids, table, sorted_pairs, num_pairs, span, E_POW2=e_pow2, CHUNK=chunk,
                                       num_warps=4)
    # fmt: on
    return sorted_pairs, block_expert


@triton.jit
def _align_count_kernel(ids_ptr, table_ptr, num_pairs, span, E_POW2: tl.constexpr, CHUNK: tl.constexpr):
    """table[p, e] = pairs of expert e among pairs [p * span, (p + 1) * span)."""
    p = tl.program_id(0)
    offs_e = tl.arange(0, E_POW2)
    counts = tl.zeros((E_POW2,), dtype=tl.int32)
    for c0 in range(p * span, tl.minimum((p + 1) * span, num_pairs), CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
    tl.store(table_ptr + p * E_POW2 + offs_e, counts)


@triton.jit
def _align_scan_kernel(
    table_ptr, sorted_pairs_ptr, block_expert_ptr, programs, num_pairs, num_experts, cap, num_blocks,
    BLOCK_M: tl.constexpr, NP_POW2: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr,
):
    """table[p, e] <- pad_start[e] + pairs of expert e in the spans before p; sentinel P in every slot (the
    scatter kernel, launched after, overwrites the pairs' slots); block experts as the one-program kernel."""
    offs_p = tl.arange(0, NP_POW2)
    offs_e = tl.arange(0, E_POW2)
    idx = offs_p[:, None] * E_POW2 + offs_e[None, :]
    tab = tl.load(table_ptr + idx, mask=(offs_p < programs)[:, None], other=0)  # [NP, Ep]
    counts = tl.sum(tab, axis=0)  # [Ep]
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)
    pad_start = pad_end - padded
    tl.store(table_ptr + idx, tl.cumsum(tab, axis=0) - tab + pad_start[None, :], mask=(offs_p < programs)[:, None])
    real_e = offs_e < num_experts
    for s0 in range(0, cap, CHUNK):
        offs = s0 + tl.arange(0, CHUNK)
        tl.store(sorted_pairs_ptr + offs, tl.zeros((CHUNK,), dtype=tl.int32) + num_pairs, mask=offs < cap)
    for b0 in range(0, num_blocks, CHUNK):
        blk = b0 + tl.arange(0, CHUNK)
        be = tl.sum(((pad_end[None, :] <= (blk * BLOCK_M)[:, None]) & real_e[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blk, be, mask=blk < num_blocks)


@triton.jit
def _align_scatter_kernel(ids_ptr, table_ptr, sorted_pairs_ptr, num_pairs, span, E_POW2: tl.constexpr,
                          CHUNK: tl.constexpr):
    """Each pair of span p to its slot: table[p, e] (its expert group's next free slot) + its rank."""
    p = tl.program_id(0)
    offs_e = tl.arange(0, E_POW2)
    running = tl.load(table_ptr + p * E_POW2 + offs_e)  # [Ep]
    for c0 in range(p * span, tl.minimum((p + 1) * span, num_pairs), CHUNK):
        running = _scatter_chunk(ids_ptr, sorted_pairs_ptr, c0, num_pairs, running, offs_e, CHUNK)


def _align_pairs_torch(
    topk_ids: torch.Tensor,  # [T, K] int
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_pairs` with ~20 torch ops (sort, cumsum, searchsorted...): any size, launch-heavy."""
    dev = topk_ids.device
    num_pairs = topk_ids.numel()
    flat = topk_ids.reshape(-1).to(torch.int64)  # [P]
    sorted_e, order = torch.sort(flat, stable=True)  # [P], [P]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    padded = (counts + (block_m - 1)) // block_m * block_m  # [E]
    pad_end = torch.cumsum(padded, 0)  # [E] inclusive ends of each expert's padded group
    pad_start = pad_end - padded  # [E]
    start = torch.cumsum(counts, 0) - counts  # [E] start of each expert's run in sorted order
    rank = torch.arange(num_pairs, device=dev) - start[sorted_e]  # [P] position inside its group
    dest = pad_start[sorted_e] + rank  # [P] slot in the padded buffer
    # At most min(E, P) experts are touched, each wasting at most BM-1 slots.
    cap = padded_capacity(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((cap,), num_pairs, dtype=torch.int64, device=dev)  # [S]
    sorted_pairs.scatter_(0, dest, order)
    block_start = torch.arange(0, cap, block_m, device=dev)  # [B]
    block_expert = torch.searchsorted(pad_end, block_start, right=True)  # [B] in [0, E]
    return sorted_pairs.to(torch.int32), block_expert.to(torch.int32)


@triton.jit
def _tile_ids(pid, num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M consecutive M blocks share each N tile (weight reuse in L2)."""
    width = GROUP_M * num_n_blocks
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _dequant_tile(w, s_ptrs, k_off, mask_n):
    """A [BK, BN] tile of e4m3 codes -> code * its block's scale, fp32; the caller rounds it once to
    the activation dtype: the same values as ExpertWeights.dequantized (BK never straddles a block)."""
    sc = tl.load(s_ptrs + k_off, mask=mask_n, other=0.0)  # [BN]
    return w.to(tl.float32) * sc[None, :]


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, inter_ptr, sorted_pairs_ptr, block_expert_ptr, weights_ptr,
    num_pairs, num_experts, num_m_blocks, H, I_SIZE, top_k,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_ip, stride_ii,
    s_ptr, stride_se, stride_sn, stride_sk, up_scale_row, delta_ptr, stride_dp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    IEEE: tl.constexpr, FP8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, DELTA: tl.constexpr,
    DIRECT: tl.constexpr,
):
    """inter[pair, n] = silu(x[tok] . gate_e[n]) * (x[tok] . up_e[n]) for one [BM pairs, BN] tile.
    FP8: the weights are e4m3 codes with (SBN x SBK) block scales at s_ptr (gate's rows, then up's
    from row up_scale_row), dequantized tile by tile (see `_dequant_tile`).
    DIRECT (no align, see `fused_moe`): block m holds pair m alone, its expert read from the flat ids at
    block_expert_ptr; a pair of routing weight 0 is skipped (its down tile writes zeros)."""
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(I_SIZE, BLOCK_N)
    pid_m, pid_n = _tile_ids(pid, num_m_blocks, num_n_blocks, GROUP_M)
    e = tl.load(block_expert_ptr + pid_m)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I_SIZE
    if DIRECT:
        if tl.load(weights_ptr + pid_m) == 0:  # nothing to add (hybrid: a pair the CPU computes); its row zeros,
            # as expert LoRA's down deltas read every row (0 * the garbage of an empty buffer could be NaN)
            tl.store(inter_ptr + pid_m.to(tl.int64) * stride_ip + offs_n * stride_ii,
                     tl.zeros((BLOCK_N,), dtype=inter_ptr.dtype.element_ty), mask=mask_n)
            return
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs)  # [BM]: the block's one pair, sentinels
    else:
        if e >= num_experts:  # padding block past the last used expert group
            return
        pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    valid_m = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xh  # [BM, BK]
    w_base = w_ptr + e.to(tl.int64) * stride_we
    g_ptrs = w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wh  # [BK, BN]
    u_ptrs = g_ptrs + I_SIZE * stride_wn
    gs_ptrs = s_ptr + e.to(tl.int64) * stride_se + (offs_n // SBN) * stride_sn  # [BN] (FP8 only)
    us_ptrs = gs_ptrs + up_scale_row * stride_sn

    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_left = H - k0
        a = tl.load(a_ptrs, mask=valid_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        wmask = (offs_k[:, None] < k_left) & mask_n[None, :]
        g = tl.load(g_ptrs, mask=wmask, other=0.0)
        u = tl.load(u_ptrs, mask=wmask, other=0.0)
        if FP8:
            g = _dequant_tile(g, gs_ptrs, k0 // SBK * stride_sk, mask_n).to(a.dtype)
            u = _dequant_tile(u, us_ptrs, k0 // SBK * stride_sk, mask_n).to(a.dtype)
        if IEEE:
            acc_g += tl.dot(a, g, input_precision="ieee")
            acc_u += tl.dot(a, u, input_precision="ieee")
        else:
            acc_g += tl.dot(a, g)
            acc_u += tl.dot(a, u)
        a_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K * stride_wh
        u_ptrs += BLOCK_K * stride_wh

    if DELTA:  # LoRA: per-pair gate and up deltas [P, 2I] added before the activation
        d_ptrs = delta_ptr + pairs[:, None].to(tl.int64) * stride_dp + offs_n[None, :]
        dmask = valid_m[:, None] & mask_n[None, :]
        acc_g += tl.load(d_ptrs, mask=dmask, other=0.0).to(tl.float32)
        acc_u += tl.load(d_ptrs + I_SIZE, mask=dmask, other=0.0).to(tl.float32)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up, fp32
    out_ptrs = inter_ptr + pairs[:, None].to(tl.int64) * stride_ip + offs_n[None, :] * stride_ii
    tl.store(out_ptrs, h.to(inter_ptr.dtype.element_ty), mask=valid_m[:, None] & mask_n[None, :])


@triton.jit
def _down_kernel(
    inter_ptr, w_ptr, out_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_pairs, num_experts, num_m_blocks, H, I_SIZE,
    stride_ip, stride_ii, stride_we, stride_wn, stride_wk, stride_op, stride_oh,
    s_ptr, stride_se, stride_sn, stride_sk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    IEEE: tl.constexpr, FP8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, DIRECT: tl.constexpr,
):
    """out_pairs[pair, n] = w[pair] * (inter[pair] . down_e[n]) for one [BM pairs, BN] tile (FP8 and
    DIRECT: as in the gate/up kernel)."""
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(H, BLOCK_N)
    pid_m, pid_n = _tile_ids(pid, num_m_blocks, num_n_blocks, GROUP_M)
    e = tl.load(block_expert_ptr + pid_m)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    if DIRECT:
        if tl.load(weights_ptr + pid_m) == 0:  # skipped by the gate/up kernel: the pair adds zeros
            tl.store(out_ptr + pid_m.to(tl.int64) * stride_op + offs_n * stride_oh,
                     tl.zeros((BLOCK_N,), dtype=out_ptr.dtype.element_ty), mask=mask_n)
            return
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs)  # [BM]
    else:
        if e >= num_experts:
            return
        pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    valid_m = pairs < num_pairs
    rows = pairs.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = inter_ptr + rows[:, None] * stride_ip + offs_k[None, :] * stride_ii  # [BM, BK]
    b_ptrs = (w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
              + offs_k[:, None] * stride_wk)  # [BK, BN]
    s_ptrs = s_ptr + e.to(tl.int64) * stride_se + (offs_n // SBN) * stride_sn  # [BN] (FP8 only)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I_SIZE, BLOCK_K):
        k_left = I_SIZE - k0
        a = tl.load(a_ptrs, mask=valid_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if FP8:
            b = _dequant_tile(b, s_ptrs, k0 // SBK * stride_sk, mask_n).to(a.dtype)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K * stride_ii
        b_ptrs += BLOCK_K * stride_wk

    rw = tl.load(weights_ptr + rows, mask=valid_m, other=0.0).to(tl.float32)  # [BM] routing weights
    acc = acc * rw[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_op + offs_n[None, :] * stride_oh
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid_m[:, None] & mask_n[None, :])


@triton.jit
def _sum_pairs_kernel(pairs_ptr, out_ptr, H, K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, n] = sum_j pairs[t * K + j, n], accumulated in fp32 and rounded once."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(K):
        acc += tl.load(pairs_ptr + (t * K + j) * H + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_pairs(out_pairs: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:  # [T*K, H] -> [T, H]
    """The K expert outputs of each token summed: one small kernel (torch's generic reduction
    took ~4.7 us per layer at decode on the H200, twice this)."""
    hidden = out_pairs.shape[1]
    out = torch.empty((num_tokens, hidden), dtype=out_pairs.dtype, device=out_pairs.device)
    block = min(1024, triton.next_power_of_2(hidden))
    _sum_pairs_kernel[(num_tokens, triton.cdiv(hidden, block))](out_pairs, out, hidden, K=top_k, BLOCK=block,
                                                               num_warps=4)
    return out


def fp8_block_ok(block: tuple[int, int] | None) -> bool:
    """Whether the fused kernels take fp8 experts in this block: bk a power of two >= 16 (the K tile
    is capped at bk and must divide it; tl.dot needs K >= 16)."""
    return block is not None and block[1] >= 16 and block[1] & (block[1] - 1) == 0 and block[0] >= 1


def fused_moe(
    x: torch.Tensor,  # [T, H]
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
    topk_ids: torch.Tensor,  # [T, K] int
    topk_weights: torch.Tensor,  # [T, K] float
    config: MoEKernelConfig | None = None,
    gate_up_scale: torch.Tensor | None = None,  # fp8: [E, 2*ceil(I/bn), ceil(H/bk)] float32
    down_scale: torch.Tensor | None = None,  # fp8: [E, ceil(H/bn), ceil(I/bk)] float32
    block: tuple[int, int] | None = None,  # fp8: (bn, bk)
    lora=None,  # lora/experts.PairDeltas: gate/up deltas before the activation, down deltas after down
) -> torch.Tensor:  # [T, H], dtype of x
    """out[t] = sum_j w[t, j] * down_e(silu(gate_e x[t]) * up_e x[t]), e = ids[t, j]. Sync-free.

    Block-scaled fp8 weights (gate_up/down float8_e4m3fn with their scales, the ExpertWeights fp8
    form): read as 1 byte per weight and dequantized in registers to x's dtype (weight-only: the
    activations are not quantized), so the result is that of the dequantized weights. Needs bk a
    power of two >= 16 (`fp8_block_ok`); the K tiles are capped at bk."""
    num_tokens, hidden = x.shape
    num_experts = gate_up.shape[0]
    inter_size = down.shape[2]
    top_k = topk_ids.shape[1]
    assert gate_up.shape == (num_experts, 2 * inter_size, hidden), gate_up.shape
    assert down.shape == (num_experts, hidden, inter_size), down.shape
    assert topk_ids.shape == topk_weights.shape == (num_tokens, top_k)
    if num_tokens == 0:
        return torch.empty((0, hidden), dtype=x.dtype, device=x.device)
    cfg = config or choose_config(num_tokens, num_experts, top_k, hidden, inter_size)
    num_pairs = num_tokens * top_k
    weights = topk_weights.reshape(-1).contiguous()  # [P]
    # One token: its K pairs have distinct experts (top-k), so grouping them by expert would give each its own
    # block anyway; DIRECT launches that layout without the align kernel (one launch of ~5 us a layer in a
    # batch-1 decode graph) and skips the pairs of weight 0 (hybrid: those the CPU computes, which grouping
    # would send to expert 0 and read its weights for)
    direct = num_tokens == 1 and envs.moe_direct()
    if direct:
        sorted_pairs, block_expert = weights, topk_ids.reshape(-1)  # [P] each; sorted_pairs unread
    else:
        sorted_pairs, block_expert = align_pairs(topk_ids, num_experts, cfg.block_m)
    fp8 = gate_up_scale is not None
    if fp8:
        assert down_scale is not None and fp8_block_ok(block), f"fp8 experts: block {block}"
        assert gate_up_scale.shape == (num_experts, 2 * triton.cdiv(inter_size, block[0]),
                                       triton.cdiv(hidden, block[1])), gate_up_scale.shape
        assert down_scale.shape == (num_experts, triton.cdiv(hidden, block[0]), triton.cdiv(inter_size, block[1]))
    inter = torch.empty((num_pairs, inter_size), dtype=x.dtype, device=x.device)  # [P, I]
    launch_gate_up(x, gate_up, inter, sorted_pairs, block_expert, weights, top_k, cfg, direct=direct,
                   scale=gate_up_scale, block=block, delta=lora.gate_up(weights) if lora is not None else None)
    out_pairs = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)  # [P, H]
    launch_down(inter, down, out_pairs, weights, sorted_pairs, block_expert, cfg, direct=direct,
                scale=down_scale, block=block)
    if lora is not None:  # y_e += s B_d A_d h, weighted like the expert's output (in place)
        lora.add_down(out_pairs, inter, weights)
    if top_k == 1:
        return out_pairs
    return sum_pairs(out_pairs, num_tokens, top_k)


def launch_gate_up(
    x: torch.Tensor,  # [T, H]
    gate_up: torch.Tensor,  # [E, 2I, H]
    inter: torch.Tensor,  # [P, I] out
    sorted_pairs: torch.Tensor,  # [S] (align_pairs; unread when direct)
    block_expert: torch.Tensor,  # [B] (align_pairs), or direct: the flat ids [P]
    weights: torch.Tensor,  # [P] routing weights (read when direct)
    top_k: int,
    cfg: MoEKernelConfig,
    direct: bool = False,
    scale: torch.Tensor | None = None,  # fp8: [E, 2*ceil(I/bn), ceil(H/bk)]
    block: tuple[int, int] | None = None,  # fp8: (bn, bk)
    delta: torch.Tensor | None = None,  # LoRA: [P, 2I] float32 added before the activation
) -> None:
    """`_gate_up_kernel` over every (block, N tile): the grid and the arguments (sweep_moe_decode.py times it)."""
    num_experts, hidden, inter_size = gate_up.shape[0], gate_up.shape[2], inter.shape[1]
    num_pairs = inter.shape[0]
    fp8 = scale is not None
    sbn, sbk = block if fp8 else (1, 1)
    bk = min(cfg.gu_block_k, sbk) if fp8 else cfg.gu_block_k  # fp8: a K tile within one scale block
    s = scale if fp8 else gate_up  # an unread pointer when not fp8
    d = delta if delta is not None else weights  # an unread pointer when no LoRA
    num_m_blocks = block_expert.shape[0]
    grid = (num_m_blocks * triton.cdiv(inter_size, cfg.gu_block_n),)
    _gate_up_kernel[grid](
        x, gate_up, inter, sorted_pairs, block_expert, weights,
        num_pairs, num_experts, num_m_blocks, hidden, inter_size, top_k,
        x.stride(0), x.stride(1), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2),
        inter.stride(0), inter.stride(1),
        s, s.stride(0), s.stride(1), s.stride(2), triton.cdiv(inter_size, sbn) if fp8 else 0,
        d, d.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.gu_block_n, BLOCK_K=bk, GROUP_M=cfg.group_m,
        IEEE=x.dtype == torch.float32, FP8=fp8, SBN=sbn, SBK=sbk, DELTA=delta is not None, DIRECT=direct,
        num_warps=cfg.gu_warps, num_stages=cfg.gu_stages,
    )


def launch_down(
    inter: torch.Tensor,  # [P, I]
    down: torch.Tensor,  # [E, H, I]
    out_pairs: torch.Tensor,  # [P, H] out
    weights: torch.Tensor,  # [P] routing weights
    sorted_pairs: torch.Tensor,  # [S] (unread when direct)
    block_expert: torch.Tensor,  # [B], or direct: the flat ids [P]
    cfg: MoEKernelConfig,
    direct: bool = False,
    scale: torch.Tensor | None = None,  # fp8: [E, ceil(H/bn), ceil(I/bk)]
    block: tuple[int, int] | None = None,
) -> None:
    """`_down_kernel` over every (block, N tile)."""
    num_experts, hidden, inter_size = down.shape
    fp8 = scale is not None
    sbn, sbk = block if fp8 else (1, 1)
    bk = min(cfg.dn_block_k, sbk) if fp8 else cfg.dn_block_k
    s = scale if fp8 else down
    num_m_blocks = block_expert.shape[0]
    grid = (num_m_blocks * triton.cdiv(hidden, cfg.dn_block_n),)
    _down_kernel[grid](
        inter, down, out_pairs, weights, sorted_pairs, block_expert,
        inter.shape[0], num_experts, num_m_blocks, hidden, inter_size,
        inter.stride(0), inter.stride(1), down.stride(0), down.stride(1), down.stride(2),
        out_pairs.stride(0), out_pairs.stride(1),
        s, s.stride(0), s.stride(1), s.stride(2),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.dn_block_n, BLOCK_K=bk, GROUP_M=cfg.group_m,
        IEEE=inter.dtype == torch.float32, FP8=fp8, SBN=sbn, SBK=sbk, DIRECT=direct, num_warps=cfg.dn_warps,
        num_stages=cfg.dn_stages,
    )
