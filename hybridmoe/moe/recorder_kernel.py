"""The expert-distribution recorder's count on CUDA: one Triton launch per MoE layer.

Counting runs in every MoE layer of every forward (moe/recorder.py), decode CUDA graphs included. In torch it
took ~6 launches a layer (the int64 cast, the real-row mask's arange, compare and casts, index_add_): ~7 us of a
~95 us batch-1 decode layer on the H100 host (profile_decode.py, session 26). Here: one program per BLOCK pairs,
an int64 atomic add per pair (integer sums: the counts do not depend on the order).

Legend: T tokens, K top-k, E experts, P = T * K pairs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # pairs a program


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, valid_ptr, num_pairs, top_k, num_experts, HAS_VALID: tl.constexpr,
                  BLOCK: tl.constexpr):
    """counts[ids[p]] += 1 for every pair p of a real row (row p // K below valid[0] when HAS_VALID)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < num_pairs
    if HAS_VALID:
        m = m & (offs // top_k < tl.load(valid_ptr))
    ids = tl.load(ids_ptr + offs, mask=m, other=0).to(tl.int64)
    m = m & (ids >= 0) & (ids < num_experts)  # an id out of range counts nowhere (index_add_ would fault)
    tl.atomic_add(counts_ptr + ids, tl.full((BLOCK,), 1, tl.int64), mask=m)


def count_experts(counts: torch.Tensor, topk_ids: torch.Tensor, valid_rows: torch.Tensor | None) -> None:
    """counts [E] int64 += how many pairs of topk_ids [T, K] chose each expert, over the first valid_rows[0]
    rows (a device [1] integer tensor; None: every row). No host sync: capturable in a CUDA graph."""
    t, k = topk_ids.shape
    if t * k == 0:
        return
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    valid = valid_rows if valid_rows is not None else counts  # an unread pointer without HAS_VALID
    _count_kernel[(triton.cdiv(t * k, BLOCK),)](ids, counts, valid, t * k, k, counts.numel(),
                                                HAS_VALID=valid_rows is not None, BLOCK=BLOCK, num_warps=4)
