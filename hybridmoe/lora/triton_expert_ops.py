"""Triton kernels of the routed-expert LoRA on the fused MoE path (experts.PairDeltas): per pair
p = t * K + j with slot s = idx[t], local expert e = ids[p] and routing weight w = w[p],
    shrink  xa[p, c] = A[s, e] v[p] over K chunk c   (v: the token's x, or the pair's activation)
    expand  out[p] (+)= scale[s] (* w) B[s, e] sum_c xa[p, c]
Each program reads its pair's slot, expert and weight, so a CUDA graph replays them for any mix of
adapters; a pair with no adapter (s < 0, an empty slot) or of weight 0 (the other side's experts
in a hybrid layer, routed to expert 0 with weight 0) is skipped (zeros where the output is a
fresh buffer). Four launches per layer in all, no gather of adapter weights, no host sync. The
shrinks are split over K as in triton_ops.py (a serial loop over H per pair was latency-bound).

The gate/up halves share one launch each: A is gate_up_A [S, E, 2R, H] (rows [0, R) gate, [R, 2R)
up), B is gate_up_B [S, E, 2I, R] (rows [0, I) gate, [I, 2I) up) and output column n takes the xa
half n >= I.

Legend: P pairs, T tokens, K top-k, S slots, E local experts, R max rank, H hidden, I intermediate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridmoe.lora.triton_ops import split_k


@triton.jit
def _pair_shrink(v_ptr, a_ptr, scale_ptr, idx_ptr, ids_ptr, w_ptr, xa_ptr, KIN, RA, K_PER, TOPK, V_DIV,
                 stride_v, stride_as, stride_ae, stride_ar, stride_xa,
                 BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """xa[p, c] = A[s, e] v[row] over K chunk c (partial sums; the expand adds the chunks, scales
    and weighs). A skipped pair writes nothing: the expand skips it by the same test."""
    p = tl.program_id(0)
    c = tl.program_id(1)
    s = tl.load(idx_ptr + p // TOPK).to(tl.int64)
    w = tl.load(w_ptr + p).to(tl.float32)
    sc = tl.load(scale_ptr + tl.maximum(s, 0))
    if (s < 0) | (w == 0.0) | (sc == 0.0):
        return
    e = tl.load(ids_ptr + p).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    row = (p // V_DIV).to(tl.int64)
    a_base = a_ptr + s * stride_as + e * stride_ae
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    k_beg = c * K_PER
    for k0 in range(0, K_PER, BLOCK_K):
        offs_k = k_beg + k0 + tl.arange(0, BLOCK_K)
        v = tl.load(v_ptr + row * stride_v + offs_k, mask=offs_k < KIN, other=0.0).to(tl.float32)
        a = tl.load(a_base + offs_r[:, None] * stride_ar + offs_k[None, :],
                    mask=(offs_r[:, None] < RA) & (offs_k[None, :] < KIN), other=0.0).to(tl.float32)
        acc += tl.sum(a * v[None, :], axis=1)
    tl.store(xa_ptr + p * stride_xa + c * RA + offs_r, acc, mask=offs_r < RA)


@triton.jit
def _pair_expand(xa_ptr, b_ptr, scale_ptr, idx_ptr, ids_ptr, w_ptr, y_ptr, N, NHALF, R, RA, C, TOPK,
                 stride_xa, stride_bs, stride_be, stride_bn, stride_y,
                 ACCUM: tl.constexpr, TIMES_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    p = tl.program_id(0)
    nb = tl.program_id(1)
    s = tl.load(idx_ptr + p // TOPK).to(tl.int64)
    w = tl.load(w_ptr + p).to(tl.float32)
    sc = tl.load(scale_ptr + tl.maximum(s, 0))
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    yp = y_ptr + p * stride_y + offs_n
    if (s < 0) | (w == 0.0) | (sc == 0.0):
        if not ACCUM:
            tl.store(yp, tl.zeros([BLOCK_N], dtype=tl.float32), mask=offs_n < N)
        return
    e = tl.load(ids_ptr + p).to(tl.int64)
    if TIMES_W:
        sc = sc * w
    offs_r = tl.arange(0, BLOCK_R)
    offs_c = tl.arange(0, BLOCK_C)
    # the K chunks' partial sums of both halves of xa (a gate/up B's up half reads the up half)
    cm = (offs_c[:, None] < C) & (offs_r[None, :] < R)
    xp = xa_ptr + p * stride_xa + offs_c[:, None] * RA + offs_r[None, :]
    lo = tl.sum(tl.load(xp, mask=cm, other=0.0), axis=0) * sc  # [BLOCK_R]
    hm = (offs_c[:, None] < C) & (offs_r[None, :] < RA - R)  # no up half (down: RA == R): nothing
    hi = tl.sum(tl.load(xp + R, mask=hm, other=0.0), axis=0) * sc
    half = offs_n >= NHALF
    xa = tl.where(half[:, None], hi[None, :], lo[None, :])  # [BLOCK_N, BLOCK_R]
    m = (offs_n[:, None] < N) & (offs_r[None, :] < R)
    b = tl.load(b_ptr + s * stride_bs + e * stride_be + offs_n[:, None] * stride_bn + offs_r[None, :], mask=m,
                other=0.0).to(tl.float32)
    d = tl.sum(b * xa, axis=1)  # [BLOCK_N]
    if ACCUM:
        y = tl.load(yp, mask=offs_n < N, other=0.0)
        tl.store(yp, (y.to(tl.float32) + d).to(y.dtype), mask=offs_n < N)
    else:
        tl.store(yp, d, mask=offs_n < N)


def _block_r(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


def _shrink(v: torch.Tensor, a: torch.Tensor, scale, idx, ids, weights, top_k: int, v_div: int) -> torch.Tensor:
    """The partial sums [P, C, RA] of A[s, e] v over C K chunks (triton_ops.split_k)."""
    p, kin = ids.shape[0], v.shape[1]
    ra = a.shape[2]
    block_r = _block_r(ra)
    block_k, per, chunks = split_k(p, kin, block_r)
    xa = torch.empty(p, chunks, ra, dtype=torch.float32, device=v.device)  # [P, C, RA]
    _pair_shrink[(p, chunks)](v, a, scale, idx, ids, weights, xa, kin, ra, per, top_k, v_div, v.stride(0),
                              a.stride(0), a.stride(1), a.stride(2), xa.stride(0), BLOCK_R=block_r, BLOCK_K=block_k)
    return xa


def _expand(xa: torch.Tensor, b: torch.Tensor, scale, idx, ids, weights, y: torch.Tensor, nhalf: int, r: int,
            top_k: int, accum: bool, times_w: bool) -> None:
    p, chunks, ra = xa.shape
    n = b.shape[2]
    block_n = 64
    _pair_expand[(p, triton.cdiv(n, block_n))](xa, b, scale, idx, ids, weights, y, n, nhalf, r, ra, chunks, top_k,
                                               xa.stride(0), b.stride(0), b.stride(1), b.stride(2), y.stride(0),
                                               ACCUM=accum, TIMES_W=times_w, BLOCK_R=_block_r(r),
                                               BLOCK_C=triton.next_power_of_2(chunks), BLOCK_N=block_n)


def gate_up_deltas(x: torch.Tensor,  # [T, H]
                   gate_up_A: torch.Tensor,  # [S, E, 2R, H]
                   gate_up_B: torch.Tensor,  # [S, E, 2I, R]
                   scale: torch.Tensor,  # [S] float32
                   idx: torch.Tensor,  # [T] int: slot per token, -1 none
                   ids: torch.Tensor,  # [P] int local expert per pair (contiguous)
                   weights: torch.Tensor,  # [P] float routing weight per pair
                   top_k: int) -> torch.Tensor:  # [P, 2I] float32
    p = ids.shape[0]
    r2, i2 = gate_up_A.shape[2], gate_up_B.shape[2]
    assert x.stride(1) == 1 and gate_up_A.stride(3) == 1 and gate_up_B.stride(3) == 1
    delta = torch.empty(p, i2, dtype=torch.float32, device=x.device)  # [P, 2I]
    if p == 0:
        return delta
    xa = _shrink(x, gate_up_A, scale, idx, ids, weights, top_k, top_k)
    _expand(xa, gate_up_B, scale, idx, ids, weights, delta, i2 // 2, r2 // 2, top_k, accum=False, times_w=False)
    return delta


def add_down_deltas(out_pairs: torch.Tensor,  # [P, H], updated in place: += w * s B_d A_d h
                    inter: torch.Tensor,  # [P, I] the pairs' activations
                    down_A: torch.Tensor,  # [S, E, R, I]
                    down_B: torch.Tensor,  # [S, E, H, R]
                    scale: torch.Tensor, idx: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    top_k: int) -> torch.Tensor:
    p = inter.shape[0]
    if p == 0:
        return out_pairs
    r, h = down_A.shape[2], down_B.shape[2]
    assert inter.stride(1) == 1 and out_pairs.stride(1) == 1 and down_A.stride(3) == 1 and down_B.stride(3) == 1
    xa = _shrink(inter, down_A, scale, idx, ids, weights, top_k, 1)
    _expand(xa, down_B, scale, idx, ids, weights, out_pairs, h, r, top_k, accum=True, times_w=True)
    return out_pairs
