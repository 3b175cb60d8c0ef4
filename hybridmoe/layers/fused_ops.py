"""Fused elementwise ops of a decoder layer, each a Triton kernel next to its torch reference.

Decode runs one token per sequence, so a layer is dominated by launch count, not bytes: these
kernels turn ~35 small launches per layer (norms, residual adds, RoPE, routing) into 5.
`use_triton(x)` picks the kernel on CUDA and the reference elsewhere (CPU, no Triton).

Legend: T tokens, H hidden, Nh heads, D head dim, E experts, K top-k.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs
    HAVE_TRITON = False


def use_triton(x: torch.Tensor) -> bool:
    # Under the Triton interpreter (tests on CPU) the kernels run on CPU tensors too.
    return HAVE_TRITON and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


# ---------------------------------------------------------------- references (torch)
def add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual), with the HF op order and roundings."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, x


def qk_norm_rope_ref(
    x: torch.Tensor,  # [T, Nh, D]
    weight: torch.Tensor | None,  # [D] per-head RMSNorm weight, or None for no norm
    eps: float,
    cos: torch.Tensor,  # [max_pos, D/2] float32
    sin: torch.Tensor,
    positions: torch.Tensor,  # [T]
) -> torch.Tensor:
    if weight is not None:
        x, _ = add_rmsnorm_ref(x, None, weight, eps)
    c = torch.cat([cos[positions], cos[positions]], -1).unsqueeze(1).to(x.dtype)  # [T, 1, D]
    s = torch.cat([sin[positions], sin[positions]], -1).unsqueeze(1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * c + torch.cat([-x2, x1], dim=-1) * s


def topk_softmax_ref(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


# ---------------------------------------------------------------- Triton kernels
if HAVE_TRITON:

    @triton.jit
    def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, n, eps,
                            HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + row * n + offs, mask=mask, other=0.0)
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(r_ptr + row * n + offs, mask=mask, other=0.0).to(tl.float32))
            x = x.to(out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * n + offs, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / n
        normed = (xf * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _qk_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, num_heads, half, eps,
                             HAS_NORM: tl.constexpr, BLOCK: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        base = (tok * num_heads + head) * 2 * half
        offs = tl.arange(0, BLOCK)
        mask = offs < half
        x1 = tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + base + half + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            var = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * half)
            r = tl.rsqrt(var + eps)
            w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
            x1 = (x1 * r).to(out_ptr.dtype.element_ty).to(tl.float32) * w1
            x2 = (x2 * r).to(out_ptr.dtype.element_ty).to(tl.float32) * w2
            x1 = x1.to(out_ptr.dtype.element_ty).to(tl.float32)
            x2 = x2.to(out_ptr.dtype.element_ty).to(tl.float32)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        c = tl.load(cos_ptr + pos * half + offs, mask=mask, other=0.0).to(out_ptr.dtype.element_ty).to(tl.float32)
        s = tl.load(sin_ptr + pos * half + offs, mask=mask, other=0.0).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + base + offs, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + base + half + offs, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _topk_softmax_kernel(logits_ptr, w_ptr, ids_ptr, n_experts, K: tl.constexpr, RENORM: tl.constexpr,
                             BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n_experts
        lg = tl.load(logits_ptr + row * n_experts + offs, mask=mask, other=float("-inf")).to(tl.float32)
        m = tl.max(lg, axis=0)
        e = tl.where(mask, tl.exp(lg - m), 0.0)
        p = e / tl.sum(e, axis=0)
        total = 1.0
        if RENORM:  # first pass: the sum of the top-k probabilities
            total = 0.0
            q = p
            for _j in tl.static_range(K):
                best = tl.max(q, axis=0)
                total += best
                q = tl.where(offs == tl.min(tl.where(q == best, offs, BLOCK), axis=0), -1.0, q)
        for j in tl.static_range(K):
            best = tl.max(p, axis=0)
            idx = tl.min(tl.where(p == best, offs, BLOCK), axis=0)  # first index of the max
            tl.store(w_ptr + row * K + j, best / total)
            tl.store(ids_ptr + row * K + j, idx.to(tl.int32))
            p = tl.where(offs == idx, -1.0, p)


# ---------------------------------------------------------------- dispatchers
def add_rmsnorm(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor | None,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """normed [T, H], new residual [T, H] (= x + residual, or x)."""
    if not use_triton(x) or x.shape[0] == 0:
        return add_rmsnorm_ref(x, residual, weight, eps)
    x = x.contiguous()
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    n = x.shape[-1]
    _add_rmsnorm_kernel[(x.shape[0],)](x, residual.contiguous() if residual is not None else x, weight, out,
                                       res_out, n, eps, HAS_RES=residual is not None,
                                       BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 4096 else 8)
    return out, res_out


def qk_norm_rope(x, weight, eps, cos, sin, positions) -> torch.Tensor:  # [T, Nh, D] -> [T, Nh, D]
    if not use_triton(x) or x.shape[0] == 0:
        return qk_norm_rope_ref(x, weight, eps, cos, sin, positions)
    x = x.contiguous()
    t, nh, d = x.shape
    out = torch.empty_like(x)
    half = d // 2
    _qk_norm_rope_kernel[(t, nh)](x, weight if weight is not None else x, cos, sin, positions, out, nh, half, eps,
                                  HAS_NORM=weight is not None, BLOCK=triton.next_power_of_2(half), num_warps=1)
    return out


def topk_softmax(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [T, K] float32 and expert ids [T, K] int32."""
    t, e = logits.shape
    if not use_triton(logits) or t == 0 or e > 4096:
        return topk_softmax_ref(logits, k, renormalize)
    logits = logits.contiguous()
    w = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int32, device=logits.device)
    _topk_softmax_kernel[(t,)](logits, w, ids, e, K=k, RENORM=renormalize, BLOCK=triton.next_power_of_2(e),
                               num_warps=4)
    return w, ids
