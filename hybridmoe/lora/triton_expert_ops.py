"""Triton kernels of the routed-expert LoRA on the fused MoE path (experts.PairDeltas): per pair
p = t * K + j with slot s = idx[t], local expert e = ids[p] and routing weight w = w[p],
    shrink  xa[p] = scale[s] (* w) A[s, e] v[p]      (v: the token's x, or the pair's activation)
    expand  out[p] (+)= B[s, e] xa[p]
Each program reads its pair's slot, expert and weight, so a CUDA graph replays them for any mix of
adapters; a pair with no adapter (s < 0, an empty slot) or of weight 0 (the other side's experts
in a hybrid layer, routed to expert 0 with weight 0) is skipped (zeros where the output is a
fresh buffer). Four launches per layer in all, no gather of adapter weights, no host sync.

The gate/up halves share one launch each: A is gate_up_A [S, E, 2R, H] (rows [0, R) gate, [R, 2R)
up), B is gate_up_B [S, E, 2I, R] (rows [0, I) gate, [I, 2I) up) and output column n takes the xa
half n >= I.

Legend: P pairs, T tokens, K top-k, S slots, E local experts, R max rank, H hidden, I intermediate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pair_shrink(v_ptr, a_ptr, scale_ptr, idx_ptr, ids_ptr, w_ptr, xa_ptr, KIN, RA, TOPK, V_DIV,
                 stride_v, stride_as, stride_ae, stride_ar, stride_xa,
                 TIMES_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.program_id(0)
    s = tl.load(idx_ptr + p // TOPK).to(tl.int64)
    e = tl.load(ids_ptr + p).to(tl.int64)
    w = tl.load(w_ptr + p).to(tl.float32)
    sc = tl.load(scale_ptr + tl.maximum(s, 0))
    offs_r = tl.arange(0, BLOCK_R)
    if (s < 0) | (w == 0.0) | (sc == 0.0):
        tl.store(xa_ptr + p * stride_xa + offs_r, tl.zeros([BLOCK_R], dtype=tl.float32), mask=offs_r < RA)
        return
    row = (p // V_DIV).to(tl.int64)
    a_base = a_ptr + s * stride_as + e * stride_ae
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, KIN, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(v_ptr + row * stride_v + offs_k, mask=offs_k < KIN, other=0.0).to(tl.float32)
        a = tl.load(a_base + offs_r[:, None] * stride_ar + offs_k[None, :],
                    mask=(offs_r[:, None] < RA) & (offs_k[None, :] < KIN), other=0.0).to(tl.float32)
        acc += tl.sum(a * v[None, :], axis=1)
    acc = acc * sc
    if TIMES_W:
        acc = acc * w
    tl.store(xa_ptr + p * stride_xa + offs_r, acc, mask=offs_r < RA)


@triton.jit
def _pair_expand(xa_ptr, b_ptr, scale_ptr, idx_ptr, ids_ptr, w_ptr, y_ptr, N, NHALF, R, TOPK,
                 stride_xa, stride_bs, stride_be, stride_bn, stride_y,
                 ACCUM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    p = tl.program_id(0)
    nb = tl.program_id(1)
    s = tl.load(idx_ptr + p // TOPK).to(tl.int64)
    e = tl.load(ids_ptr + p).to(tl.int64)
    w = tl.load(w_ptr + p).to(tl.float32)
    sc = tl.load(scale_ptr + tl.maximum(s, 0))
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    yp = y_ptr + p * stride_y + offs_n
    if (s < 0) | (w == 0.0) | (sc == 0.0):
        if not ACCUM:
            tl.store(yp, tl.zeros([BLOCK_N], dtype=tl.float32), mask=offs_n < N)
        return
    offs_r = tl.arange(0, BLOCK_R)
    half = (offs_n >= NHALF).to(tl.int64)  # the up half of a gate/up B reads the up half of xa
    m = (offs_n[:, None] < N) & (offs_r[None, :] < R)
    xa = tl.load(xa_ptr + p * stride_xa + half[:, None] * R + offs_r[None, :], mask=m, other=0.0)
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


def gate_up_deltas(x: torch.Tensor,  # [T, H]
                   gate_up_A: torch.Tensor,  # [S, E, 2R, H]
                   gate_up_B: torch.Tensor,  # [S, E, 2I, R]
                   scale: torch.Tensor,  # [S] float32
                   idx: torch.Tensor,  # [T] int: slot per token, -1 none
                   ids: torch.Tensor,  # [P] int local expert per pair (contiguous)
                   weights: torch.Tensor,  # [P] float routing weight per pair
                   top_k: int) -> torch.Tensor:  # [P, 2I] float32
    p, h = ids.shape[0], x.shape[1]
    r2, i2 = gate_up_A.shape[2], gate_up_B.shape[2]
    r = r2 // 2
    assert x.stride(1) == 1 and gate_up_A.stride(3) == 1 and gate_up_B.stride(3) == 1
    xa = torch.empty(p, r2, dtype=torch.float32, device=x.device)  # [P, 2R]
    delta = torch.empty(p, i2, dtype=torch.float32, device=x.device)  # [P, 2I]
    if p == 0:
        return delta
    _pair_shrink[(p,)](x, gate_up_A, scale, idx, ids, weights, xa, h, r2, top_k, top_k, x.stride(0),
                       gate_up_A.stride(0), gate_up_A.stride(1), gate_up_A.stride(2), xa.stride(0),
                       TIMES_W=False, BLOCK_R=_block_r(r2), BLOCK_K=64)
    block_n = 64
    _pair_expand[(p, triton.cdiv(i2, block_n))](xa, gate_up_B, scale, idx, ids, weights, delta, i2, i2 // 2, r,
                                                top_k, xa.stride(0), gate_up_B.stride(0), gate_up_B.stride(1),
                                                gate_up_B.stride(2), delta.stride(0), ACCUM=False,
                                                BLOCK_R=_block_r(r), BLOCK_N=block_n)
    return delta


def add_down_deltas(out_pairs: torch.Tensor,  # [P, H], updated in place: += w * s B_d A_d h
                    inter: torch.Tensor,  # [P, I] the pairs' activations
                    down_A: torch.Tensor,  # [S, E, R, I]
                    down_B: torch.Tensor,  # [S, E, H, R]
                    scale: torch.Tensor, idx: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    top_k: int) -> torch.Tensor:
    p, i = inter.shape
    if p == 0:
        return out_pairs
    r, h = down_A.shape[2], down_B.shape[2]
    assert inter.stride(1) == 1 and out_pairs.stride(1) == 1 and down_A.stride(3) == 1 and down_B.stride(3) == 1
    xa = torch.empty(p, r, dtype=torch.float32, device=inter.device)  # [P, R]
    _pair_shrink[(p,)](inter, down_A, scale, idx, ids, weights, xa, i, r, top_k, 1, inter.stride(0),
                       down_A.stride(0), down_A.stride(1), down_A.stride(2), xa.stride(0),
                       TIMES_W=True, BLOCK_R=_block_r(r), BLOCK_K=64)
    block_n = 64
    _pair_expand[(p, triton.cdiv(h, block_n))](xa, down_B, scale, idx, ids, weights, out_pairs, h, h, r, top_k,
                                               xa.stride(0), down_B.stride(0), down_B.stride(1), down_B.stride(2),
                                               out_pairs.stride(0), ACCUM=True, BLOCK_R=_block_r(r),
                                               BLOCK_N=block_n)
    return out_pairs
