"""A one-token MoE router in one launch: the router GEMV and the softmax top-k (routing.route's plain form).

At batch 1 a Qwen3-30B-A3B layer's router was two launches on the H100 host (profile_decode.py, session 26):
cuBLAS's GEMV 2048 -> 128 (0.5 MB) in 5.0 us, then the top-k kernel in 3.4 us, every MoE layer of every decode
step. Here the programs each compute EP experts' logits; the last program to finish (a ticket counter, reset by
it for the next launch) takes the softmax and top-k of the row, so the second launch and its gap are gone.

Numerics are the two-launch path's: the logits are rounded to the model dtype (what nn.Linear returns) before
the softmax, which is fused_ops.softmax_topk_store (the same code as the top-k kernel). The GEMV sums in fp32
in another order than cuBLAS, so a logit may differ by one rounding step of the model dtype.

Memory order: each program publishes its logits with release exchanges and takes a ticket with an acq_rel add
after a barrier; the last one reads the row back with acquire atomics (served by L2, never a stale L1 line).

Legend: H hidden, E experts, EP experts a program, K top-k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridmoe.layers.fused_ops import softmax_topk_store

# (experts a program, H tile, warps): one expert's router row a program, in one H tile up to H 2048. bench_router.py's
# 27 configs on the H100 host (session 31, results/session31/router_h100host.json, us a call, default then this):
# Qwen3-30B-A3B 7.69 -> 6.64, Qwen3-235B 9.43 -> 7.27 (the best), Qwen2-57B 9.20 -> 6.98, Mixtral 7.05 -> 4.93 (the
# best); within 0.05 us of the best on the other two; no shape's expert ids differed from the two-launch path's.
# The configs with an H tile of 2048 led on every shape, whatever the warps.
CONFIG = (1, 2048, 4)


@triton.jit
def _router_topk_kernel(x_ptr, w_ptr, logits_ptr, ticket_ptr, wout_ptr, ids_ptr, counts_ptr, valid_ptr, H, E,
                        K: tl.constexpr, RENORM: tl.constexpr, EP: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_E: tl.constexpr, COUNT: tl.constexpr, HAS_VALID: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_e = tl.program_id(0) * EP + tl.arange(0, EP)
    me = offs_e < E
    offs_h = tl.arange(0, BLOCK_H)
    acc = tl.zeros((EP, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        mh = h0 + offs_h < H
        xv = tl.load(x_ptr + h0 + offs_h, mask=mh, other=0.0).to(tl.float32)  # [BH]
        wv = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * H + h0 + offs_h[None, :], mask=me[:, None] & mh[None, :],
                     other=0.0).to(tl.float32)  # [EP, BH]
        acc += wv * xv[None, :]
    lg = tl.sum(acc, axis=1).to(x_ptr.dtype.element_ty).to(tl.float32)  # [EP], rounded as nn.Linear's output
    # fp32 bits through int32 atomics (the Triton interpreter has no float exchange; the same bits on the GPU)
    tl.atomic_xchg(logits_ptr + offs_e, lg.to(tl.int32, bitcast=True), mask=me, sem="release")
    tl.debug_barrier()  # every thread's logits are out before the ticket is taken
    if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        tl.atomic_xchg(ticket_ptr, 0)  # the last program: reset for the next launch (stream-ordered after this one)
        offs = tl.arange(0, BLOCK_E)
        mask = offs < E
        bits = tl.atomic_add(logits_ptr + offs, tl.zeros((BLOCK_E,), dtype=tl.int32), mask=mask, sem="acquire")
        softmax_topk_store(bits.to(tl.float32, bitcast=True), offs, mask, wout_ptr, ids_ptr, K, RENORM, BLOCK_E)
        if COUNT:  # the expert-distribution recorder's count (recorder_kernel.py's, for this one row)
            tl.debug_barrier()  # the ids stored above, read back by every thread
            offs_k = tl.arange(0, BLOCK_K)
            if HAS_VALID:  # a graph's padding row (valid_rows[0] == 0) counts nothing
                mk = offs_k < tl.where(tl.load(valid_ptr) > 0, K, 0)
            else:
                mk = offs_k < K
            ids = tl.load(ids_ptr + offs_k, mask=mk, other=0).to(tl.int64)
            mk = mk & (ids >= 0) & (ids < E)
            tl.atomic_add(counts_ptr + ids, tl.full((BLOCK_K,), 1, tl.int64), mask=mk)


def new_ticket(device: torch.device) -> torch.Tensor:
    """The counter one router's launches share ([1] int32, zero between launches)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def router_topk(
    x: torch.Tensor,  # [1, H]
    weight: torch.Tensor,  # [E, H], x's dtype
    top_k: int,
    renormalize: bool,
    ticket: torch.Tensor,  # new_ticket(); never shared by launches that may run at the same time
    config: tuple[int, int, int] | None = None,  # (EP, BLOCK_H, warps), powers of two; default CONFIG
    counts: torch.Tensor | None = None,  # [E] int64: += 1 for each chosen expert (the recorder's count)
    valid_rows: torch.Tensor | None = None,  # device [1] integer: count only when valid_rows[0] > 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights [1, K] float32, ids [1, K] int32, logits [1, E] float32 rounded to x's dtype) of one token.

    With `counts`, the launch also counts the chosen experts (what recorder_kernel.count_experts would do in a
    second launch)."""
    t, h = x.shape
    e = weight.shape[0]
    assert t == 1 and weight.shape[1] == h and weight.is_contiguous() and 0 < top_k <= e <= 4096, (x.shape, weight.shape)
    x = x if x.stride(1) == 1 else x.contiguous()
    logits = torch.empty(1, e, dtype=torch.int32, device=x.device)  # fp32 bits (see the kernel)
    w = torch.empty(1, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(1, top_k, dtype=torch.int32, device=x.device)
    ep, block_h, warps = config or CONFIG
    if counts is not None:
        assert counts.shape == (e,) and counts.dtype == torch.int64 and counts.device == x.device, counts.shape
    cnt = counts if counts is not None else logits  # unread pointers without COUNT / HAS_VALID
    valid = valid_rows if valid_rows is not None else cnt
    _router_topk_kernel[(triton.cdiv(e, ep),)](x, weight, logits, ticket, w, ids, cnt, valid, h, e, K=top_k,
                                                RENORM=renormalize, EP=ep, BLOCK_H=block_h,
                                                BLOCK_E=triton.next_power_of_2(e), COUNT=counts is not None,
                                                HAS_VALID=valid_rows is not None,
                                                BLOCK_K=triton.next_power_of_2(top_k), num_warps=warps)
    return w, ids, logits.view(torch.float32)
