"""The grouped routers of routing.py (DeepSeek's noaux_tc and group_limited_greedy, and sigmoid or scaled
greedy top-k) as one Triton kernel: one program a token, the whole expert row in registers.

Why: in torch the noaux_tc selection is ~20 small kernels (sigmoid, bias add, two topks, a sort, scatter,
masked fill, gather, renormalize, scale), ~60 us of a batch-1 decode step per MoE layer on an H200, and in
hybrid decode that time sits between a layer's attention and the submission of its CPU expert task, where
the CPU pool has nothing to do. The kernel does the same selection in ~5 us.

Legend: T tokens, E experts (BLOCK_E = next power of two), G groups of E/G experts, K experts a token.
Semantics are routing.route's (the reference): ties between exactly equal scores may resolve to another
expert (the first index of the maximum here, torch.topk's own order there); the weights of a chosen set
are bit-identical in float32 up to the sigmoid/softmax rounding of the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

METHOD_IDS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}


@triton.jit
def _argmax_first(v, offs, BLOCK: tl.constexpr):
    """First index of the maximum of v (torch's order among exact ties is unspecified; this one is fixed)."""
    best = tl.max(v, axis=0)
    return tl.min(tl.where(v == best, offs, BLOCK), axis=0)


# fmt: off
@triton.jit
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr, stride_t, n_experts, per_group, scaling,
    SIGMOID: tl.constexpr, METHOD: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < n_experts
    x = tl.load(logits_ptr + t * stride_t + offs, mask=valid, other=0.0).to(tl.float32)  # [BLOCK_E]
    if SIGMOID:
        scores = tl.sigmoid(x)
    else:
        m = tl.max(tl.where(valid, x, float("-inf")), axis=0)
        e = tl.where(valid, tl.exp(x - m), 0.0)
        scores = e / tl.sum(e, axis=0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    # A token whose scores hold NaN (its hidden state blew up): NaN compares false, so the picks below would
    # return an index past E (a read out of bounds in the GPU experts). Its choices rank last but stay
    # distinct and in range (-1e30: a group's sum of two does not reach -inf), and all its weights are NaN,
    # as the reference's are (torch ranks NaN first): its output goes NaN and its request fails alone.
    corrupt = tl.max(tl.where(scores != scores, 1, 0), axis=0) > 0
    choice = tl.where(choice != choice, -1.0e30, choice)

    if METHOD != 0 and N_GROUP > 1:
        group = offs // per_group  # [BLOCK_E] group of each expert
        goffs = tl.arange(0, BLOCK_G)
        gscore = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            c = tl.where(group == g, choice, float("-inf"))
            if METHOD == 2:  # noaux_tc: the sum of the group's two best biased scores (one if a group has one)
                i1 = _argmax_first(c, offs, BLOCK_E)
                s = tl.max(c, axis=0)
                c2 = tl.max(tl.where(offs == i1, float("-inf"), c), axis=0)
                s = s + tl.where(c2 == float("-inf"), 0.0, c2)
            else:  # group_limited_greedy: the group's best score
                s = tl.max(c, axis=0)
            gscore = tl.where(goffs == g, s, gscore)
        keep = offs < 0  # all False
        for _j in tl.static_range(TOPK_GROUP):
            gi = _argmax_first(gscore, goffs, BLOCK_G)
            keep = keep | (group == gi)
            gscore = tl.where(goffs == gi, float("-inf"), gscore)
        if METHOD == 2:
            choice = tl.where(keep, choice, float("-inf"))
        else:  # as the reference: the other groups' experts score 0 (below every kept positive score)
            choice = tl.where(keep, choice, tl.where(valid, 0.0, float("-inf")))

    koffs = tl.arange(0, BLOCK_K)
    wv = tl.zeros([BLOCK_K], tl.float32)
    iv = tl.zeros([BLOCK_K], tl.int32)
    for j in tl.static_range(K):
        i = _argmax_first(choice, offs, BLOCK_E)
        if METHOD == 1:  # the weight is the (possibly zero-filled) selection score itself
            w = tl.max(tl.where(offs == i, choice, float("-inf")), axis=0)
        else:  # the unbiased score of the chosen expert
            w = tl.sum(tl.where(offs == i, scores, 0.0), axis=0)
        wv = tl.where(koffs == j, w, wv)
        iv = tl.where(koffs == j, i.to(tl.int32), iv)
        choice = tl.where(offs == i, float("-inf"), choice)
    if RENORM:
        wv = wv / (tl.sum(wv, axis=0) + 1e-20)
    wv = tl.where(corrupt, float("nan"), wv * scaling)
    kmask = koffs < K
    tl.store(w_ptr + t * K + koffs, wv, mask=kmask)
    tl.store(ids_ptr + t * K + koffs, iv, mask=kmask)
# fmt: on


def grouped_topk(
    logits: torch.Tensor,  # [T, E], any float dtype
    *,
    top_k: int,
    scoring: str,
    method: str,
    renormalize: bool,
    n_group: int,
    topk_group: int,
    scaling: float,
    bias: torch.Tensor | None = None,  # [E]
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, K] float32, ids [T, K] int32
    """routing.route's selection in one kernel launch (no host synchronization: graph-capturable)."""
    t, e = logits.shape
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    assert 0 < top_k <= e and e % n_group == 0
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t == 0:
        return w, ids
    block_e = triton.next_power_of_2(e)
    _grouped_topk_kernel[(t,)](
        logits, bias if bias is not None else logits, w, ids, logits.stride(0), e, e // n_group, float(scaling),
        SIGMOID=scoring == "sigmoid", METHOD=METHOD_IDS[method], HAS_BIAS=bias is not None, RENORM=renormalize,
        N_GROUP=n_group, TOPK_GROUP=topk_group, K=top_k, BLOCK_E=block_e,
        BLOCK_G=max(2, triton.next_power_of_2(n_group)), BLOCK_K=max(2, triton.next_power_of_2(top_k)),
        num_warps=4 if block_e <= 512 else 8,
    )
    return w, ids
