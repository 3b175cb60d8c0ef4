"""The hand-over between a hybrid MoE layer's GPU side and its CPU task, in one kernel each way.

Out (`handoff`, any T: hybrid.py uses it up to MAX_HANDOFF_TOKENS, beyond which the copy engine is faster): from
the router's ids and weights and the hidden states, one launch writes the CPU task's pinned inputs (x, CPU-local
ids of the pairs computed now and of the deferred ones, fp32 weights), the GPU experts' inputs (GPU-local ids and
weights, pairs of CPU experts as expert 0 with weight 0), and last the task's `go` word, which starts the task
(cuda_bridge.py). It replaces, per layer and step: the id conversion, two gathers, the deferral split's sort and
wheres, the four device-to-host copies (x, ids, weights, go) and the GPU part's wheres: ~12 stream operations that
sat between the router and the CPU task's start on the serial path of a deferral-0 step (profile_decode.py,
session 31: ~83 us a layer, ~15 of them these).

Back (`collect`): after the stream's wait for the task, one launch reads the task's pinned output (and the
previous layer's deferred one) over the bus, adds them to the GPU experts' fp32 sum, rounds to the model
dtype and adds the shared experts' term: the host-to-device copies, the adds and the cast in one.

Numerics are the unfused path's (hybrid.py): the same pairs deferred (each token's `defer` lowest-weight
CPU pairs, ties by position, as a stable ascending sort), the same fp32 sums in the same order, the same
roundings; a test compares both bit for bit.

Memory order: the stores to pinned host memory are published by a barrier and a release exchange of the go
word at system scope (the CPU's leader thread reads the word, then fences with acquire: hostcall.cpp
wait_go). With several programs, each takes a ticket after its stores (acq_rel, system scope) and the last
one sets the word and resets the ticket for the next launch. `collect` loads the pinned output volatile: the
task wrote it after the previous launch read the same buffer, so no cached line of it may be used.

Legend: T tokens, H hidden, K top-k, E experts of the layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_H = 1024


@triton.jit
def _handoff_kernel(x_ptr, ids_ptr, w_ptr, cpu_local_ptr, gpu_local_ptr, xh_ptr, idsh_ptr, ids2h_ptr, wh_ptr,
                    gid_ptr, gw_ptr, go_ptr, ticket_ptr, H, stride_x, E,
                    K: tl.constexpr, BLOCK_K: tl.constexpr, DEFER: tl.constexpr, HAS_GPU: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    mk = offs_k < K
    ids = tl.load(ids_ptr + t * K + offs_k, mask=mk, other=0).to(tl.int32)  # [BK]
    ok = mk & (ids >= 0) & (ids < E)  # (the router's ids are in range; a stray one is no CPU pair, not a fault)
    w = tl.load(w_ptr + t * K + offs_k, mask=mk, other=0.0)  # [BK] the router's dtype
    cid = tl.load(cpu_local_ptr + ids, mask=ok, other=-1)  # [BK] -1: a GPU expert
    on_cpu = cid >= 0
    wf = w.to(tl.float32)
    if DEFER > 0:
        # rank of each pair in a stable ascending sort of (weight on the CPU, +inf elsewhere): the first DEFER
        # CPU pairs of that order are deferred (hybrid.py _split)
        key = tl.where(on_cpu, wf, float("inf"))  # [BK]
        ki, kj = key[:, None], key[None, :]
        nan_i, nan_j = ki != ki, kj != kj  # NaN sorts last, as in torch's sort
        less = (ki < kj) | (nan_j & ~nan_i)
        same = (ki == kj) | (nan_i & nan_j)
        before = mk[:, None] & (less | (same & (offs_k[:, None] < offs_k[None, :])))  # [BK, BK] i sorts before j
        rank = tl.sum(before.to(tl.int32), axis=0)  # [BK]
        later = on_cpu & (rank < DEFER)
        tl.store(idsh_ptr + t * K + offs_k, tl.where(later, -1, cid), mask=mk)
        tl.store(ids2h_ptr + t * K + offs_k, tl.where(later, cid, -1), mask=mk)
    else:
        tl.store(idsh_ptr + t * K + offs_k, cid, mask=mk)
    tl.store(wh_ptr + t * K + offs_k, wf, mask=mk)
    if HAS_GPU:
        gid = tl.load(gpu_local_ptr + ids, mask=ok, other=-1)
        on_gpu = gid >= 0
        tl.store(gid_ptr + t * K + offs_k, tl.where(on_gpu, gid, 0), mask=mk)
        tl.store(gw_ptr + t * K + offs_k, tl.where(on_gpu, w, 0.0), mask=mk)
    offs_h = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        mh = h0 + offs_h < H
        xv = tl.load(x_ptr + t.to(tl.int64) * stride_x + h0 + offs_h, mask=mh)
        tl.store(xh_ptr + t.to(tl.int64) * H + h0 + offs_h, xv, mask=mh)
    tl.debug_barrier()  # every thread's stores are issued before the release below
    if tl.num_programs(0) == 1:
        tl.atomic_xchg(go_ptr, 1, sem="release", scope="sys")
    else:
        if tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="sys") == tl.num_programs(0) - 1:
            tl.atomic_xchg(ticket_ptr, 0)  # stream-ordered before the next launch
            tl.atomic_xchg(go_ptr, 1, sem="release", scope="sys")


def new_ticket(device: torch.device) -> torch.Tensor:
    """The counter one task's hand-over launches share ([1] int32, zero between launches)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def handoff(
    x: torch.Tensor,  # [T, H] model dtype, rows contiguous
    ids: torch.Tensor,  # [T, K] integer: the router's expert ids
    weights: torch.Tensor,  # [T, K] the router's weights
    cpu_local: torch.Tensor,  # [E] int32: an expert's row in the CPU task, -1 for a GPU expert
    gpu_local: torch.Tensor | None,  # [E] int32: an expert's row among the GPU experts, -1 elsewhere; None: none
    defer: int,  # CPU pairs deferred per token (0: none)
    x_h: torch.Tensor,  # pinned [>= T, H] x's dtype
    ids_h: torch.Tensor,  # pinned [>= T, K] int32: now
    ids2_h: torch.Tensor | None,  # pinned [>= T, K] int32: deferred (defer > 0)
    w_h: torch.Tensor,  # pinned [>= T, K] float32
    go: torch.Tensor,  # pinned [1] int32, set to 1 last
    ticket: torch.Tensor,  # new_ticket(); never shared by launches that may run at the same time
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Writes the CPU task's inputs and its go word; returns the GPU experts' (ids [T, K] int32, weights [T, K]
    in the router's dtype), None without GPU experts. No host sync."""
    t, k = ids.shape
    h = x.shape[1]
    assert t > 0 and x.shape[0] == t and weights.shape == (t, k) and x.stride(1) == 1, (x.shape, ids.shape)
    assert x_h.dtype == x.dtype and x_h.shape[0] >= t and x_h.shape[1] == h and x_h.is_contiguous()
    assert ids_h.dtype == torch.int32 and w_h.dtype == torch.float32 and (defer == 0 or ids2_h is not None)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    weights = weights if weights.is_contiguous() else weights.contiguous()
    has_gpu = gpu_local is not None
    gid = torch.empty(t, k, dtype=torch.int32, device=x.device) if has_gpu else ids_h
    gw = torch.empty(t, k, dtype=weights.dtype, device=x.device) if has_gpu else w_h
    _handoff_kernel[(t,)](x, ids, weights, cpu_local, gpu_local if has_gpu else cpu_local, x_h, ids_h,
                          ids2_h if defer else ids_h, w_h, gid, gw, go, ticket, h, x.stride(0), cpu_local.shape[0],
                          K=k, BLOCK_K=triton.next_power_of_2(k), DEFER=defer, HAS_GPU=has_gpu,
                          BLOCK_H=min(_BLOCK_H, triton.next_power_of_2(h)), num_warps=4)
    return (gid, gw) if has_gpu else None


@triton.jit
def _round_to(v, dtype: tl.constexpr):
    """fp32 -> dtype, rounded to nearest even. bf16 from its bits: what the GPU's conversion gives (subnormals and
    signed zeros kept), computed the same by the Triton interpreter (whose own conversion truncates to bf16 and
    flushes subnormals), so the tests can be bit-exact."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # (no int32 overflow but for NaN, replaced below)
        r = tl.where(v != v, (bits >> 16) | 0x40, r)  # a NaN stays a (quiet) NaN
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)  # exact: r fits 16 bits (arithmetic shift)
    else:
        return v.to(dtype)


@triton.jit
def _collect_kernel(gpu_ptr, cpu_ptr, cpu2_ptr, side_ptr, out_ptr, H, stride_side,
                    HAS_CPU2: tl.constexpr, HAS_SIDE: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = offs < H
    acc = tl.load(gpu_ptr + t * H + offs, mask=m, other=0.0)
    acc += tl.load(cpu_ptr + t * H + offs, mask=m, other=0.0, volatile=True)
    if HAS_CPU2:
        acc += tl.load(cpu2_ptr + t * H + offs, mask=m, other=0.0, volatile=True)
    y = _round_to(acc, out_ptr.dtype.element_ty)
    if HAS_SIDE:  # added in the model dtype, as `routed.to(dtype) + side` rounds
        y = (y.to(tl.float32) + tl.load(side_ptr + t * stride_side + offs, mask=m, other=0.0).to(tl.float32))
        y = _round_to(y, out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * H + offs, y, mask=m)


def collect(
    gpu_out: torch.Tensor,  # [T, H] float32: the GPU experts' sum
    cpu_out: torch.Tensor,  # pinned [>= T, H] float32: the CPU task's output (waited for on the stream)
    cpu_out2: torch.Tensor | None,  # pinned [>= T, H] float32: the previous layer's deferred output, or None
    side: torch.Tensor | None,  # [T, H] model dtype: the shared experts' term, or None
    dtype: torch.dtype,  # the model dtype
) -> torch.Tensor:
    """((gpu_out + cpu_out) + cpu_out2).to(dtype) + side: [T, H] dtype, the unfused path's sums and roundings."""
    t, h = gpu_out.shape
    assert gpu_out.dtype == torch.float32 and gpu_out.is_contiguous() and cpu_out.shape[0] >= t and t > 0
    assert cpu_out.shape[1] == h and cpu_out.is_contiguous() and (cpu_out2 is None or cpu_out2.is_contiguous())
    if side is not None:
        assert side.shape == (t, h) and side.stride(1) == 1 and side.dtype == dtype, (side.shape, side.dtype)
    out = torch.empty(t, h, dtype=dtype, device=gpu_out.device)
    block = min(_BLOCK_H, triton.next_power_of_2(h))
    _collect_kernel[(t, triton.cdiv(h, block))](
        gpu_out, cpu_out, cpu_out2 if cpu_out2 is not None else cpu_out, side if side is not None else out, out, h,
        side.stride(0) if side is not None else 0, HAS_CPU2=cpu_out2 is not None, HAS_SIDE=side is not None,
        BLOCK_H=block, num_warps=4)
    return out
