"""Fused elementwise ops of a decoder layer, each a Triton kernel next to its torch reference.

Decode runs one token per sequence, so a layer is dominated by launch count, not bytes: these
kernels turn ~35 small launches per layer (norms, residual adds, RoPE, KV store, routing) into 4.
`use_triton(x)` picks the kernel on CUDA and the reference elsewhere (CPU, no Triton).

Legend: T tokens, H hidden, Nh heads, D head dim, E experts, K top-k.
"""

from __future__ import annotations

import logging
import os

import torch

from hybridmoe.layers.attention.base import store_kv

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs
    HAVE_TRITON = False


log = logging.getLogger(__name__)


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


def qkv_rope_store_ref(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) D]: the fused projection's output, q | k | v
    num_heads: int,
    num_kv_heads: int,
    q_weight: torch.Tensor | None,  # [D] per-head RMSNorm weights, or None for no q/k norm
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,  # [max_pos, D/2] float32
    sin: torch.Tensor,
    positions: torch.Tensor,  # [T]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
) -> torch.Tensor:  # q [T, Hq, D]
    """q and k normed and rotated; k and v written into their cache slots; returns q."""
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q = qk_norm_rope_ref(q.reshape(t, num_heads, d), q_weight, eps, cos, sin, positions)
    k = qk_norm_rope_ref(k.reshape(t, num_kv_heads, d), k_weight, eps, cos, sin, positions)
    store_kv(k, v.reshape(t, num_kv_heads, d), k_cache, v_cache, slot_mapping)  # (FP8 caches: saturating)
    return q


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
    def _qkv_rope_store_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_out_ptr,
                               kc_ptr, vc_ptr, stride_t, num_heads, num_kv_heads, half, eps,
                               HAS_NORM: tl.constexpr, BLOCK: tl.constexpr):
        """One program per (token, head) of q and k: RMSNorm (optional) + RoPE; a k program also
        stores its k head and the matching v head into the cache slot of the token."""
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        is_q = head < num_heads
        d = 2 * half
        offs = tl.arange(0, BLOCK)
        mask = offs < half
        src = qkv_ptr + tok * stride_t + head * d  # q heads, then k heads, are adjacent in a row
        x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half + offs, mask=mask, other=0.0).to(tl.float32)
        out_ty = q_out_ptr.dtype.element_ty
        if HAS_NORM:
            var = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / d
            r = tl.rsqrt(var + eps)
            if is_q:
                w1 = tl.load(qw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                w2 = tl.load(qw_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
            else:
                w1 = tl.load(kw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                w2 = tl.load(kw_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
            x1 = ((x1 * r).to(out_ty).to(tl.float32) * w1).to(out_ty).to(tl.float32)
            x2 = ((x2 * r).to(out_ty).to(tl.float32) * w2).to(out_ty).to(tl.float32)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        c = tl.load(cos_ptr + pos * half + offs, mask=mask, other=0.0).to(out_ty).to(tl.float32)
        s = tl.load(sin_ptr + pos * half + offs, mask=mask, other=0.0).to(out_ty).to(tl.float32)
        y1 = (x1 * c - x2 * s).to(out_ty)
        y2 = (x2 * c + x1 * s).to(out_ty)
        if is_q:
            q_dst = q_out_ptr + (tok * num_heads + head) * d
            tl.store(q_dst + offs, y1, mask=mask)
            tl.store(q_dst + half + offs, y2, mask=mask)
        else:
            kh = head - num_heads
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            c_off = (slot * num_kv_heads + kh) * d  # names differ from the q branch: Triton types both
            tl.store(kc_ptr + c_off + offs, y1.to(kc_ptr.dtype.element_ty), mask=mask)
            tl.store(kc_ptr + c_off + half + offs, y2.to(kc_ptr.dtype.element_ty), mask=mask)
            vsrc = src + num_kv_heads * d  # the v head sits Hkv heads after the k head
            v1 = tl.load(vsrc + offs, mask=mask, other=0.0)
            v2 = tl.load(vsrc + half + offs, mask=mask, other=0.0)
            tl.store(vc_ptr + c_off + offs, v1.to(vc_ptr.dtype.element_ty), mask=mask)
            tl.store(vc_ptr + c_off + half + offs, v2.to(vc_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def softmax_topk_store(lg, offs, mask, w_ptr, ids_ptr, K: tl.constexpr, RENORM: tl.constexpr,
                           BLOCK: tl.constexpr):
        """Softmax of one row of logits lg [BLOCK] (fp32; lanes past `mask` ignored), its K largest
        probabilities (renormalized to sum 1 when RENORM) to w_ptr[0:K] and their expert ids to ids_ptr[0:K]
        (also the last step of moe/router_triton.py's fused router)."""
        lg = tl.where(mask, lg, float("-inf"))
        m = tl.max(lg, axis=0)
        e = tl.where(mask, tl.exp(lg - m), 0.0)
        p = e / tl.sum(e, axis=0)
        # A row with NaN or +inf logits (its hidden state blew up) has NaN probabilities, which compare false:
        # the first-index picks below would return BLOCK, an expert id out of range (a read past the GPU
        # experts' weights). Its picks rank the NaN ones after every real probability and before the taken
        # (-1) and padding (-2) lanes, so they stay distinct and in range, and its weights are all NaN, as the
        # reference's are: its output goes NaN and its request fails alone at sampling.
        corrupt = tl.max(tl.where(mask & (p != p), 1, 0), axis=0) > 0
        p = tl.where(mask, tl.where(p != p, -0.5, p), -2.0)
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
            tl.store(w_ptr + j, tl.where(corrupt, float("nan"), best / total))
            tl.store(ids_ptr + j, idx.to(tl.int32))
            p = tl.where(offs == idx, -1.0, p)

    @triton.jit
    def _topk_softmax_kernel(logits_ptr, w_ptr, ids_ptr, n_experts, K: tl.constexpr, RENORM: tl.constexpr,
                             BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n_experts
        lg = tl.load(logits_ptr + row * n_experts + offs, mask=mask, other=float("-inf")).to(tl.float32)
        softmax_topk_store(lg, offs, mask, w_ptr + row * K, ids_ptr + row * K, K, RENORM, BLOCK)


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


def qkv_rope_store(qkv, num_heads, num_kv_heads, q_weight, k_weight, eps, cos, sin, positions, k_cache, v_cache,
                   slot_mapping) -> torch.Tensor | None:
    """q/k norm + RoPE and the KV-cache store of a layer in one launch (instead of four); see
    qkv_rope_store_ref for the arguments. Returns q [T, Hq, D], or None when the fused kernel cannot
    be built here (the caller then runs the separate Triton kernels: the torch reference is many
    more launches, which costs decode more than the fusion saves)."""
    if not use_triton(qkv) or qkv.shape[0] == 0 or qkv.stride(-1) != 1 or not k_cache.is_contiguous() \
            or not v_cache.is_contiguous():
        return qkv_rope_store_ref(qkv, num_heads, num_kv_heads, q_weight, k_weight, eps, cos, sin, positions,
                                  k_cache, v_cache, slot_mapping)
    global _qkv_fused_failed
    if _qkv_fused_failed:
        return None
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    half = d // 2
    q = torch.empty(t, num_heads, d, dtype=qkv.dtype, device=qkv.device)
    has_norm = q_weight is not None
    try:
        _qkv_rope_store_kernel[(t, num_heads + num_kv_heads)](
            qkv, q_weight if has_norm else qkv, k_weight if has_norm else qkv, cos, sin, positions, slot_mapping,
            q, k_cache, v_cache, qkv.stride(0), num_heads, num_kv_heads, half, eps,
            HAS_NORM=has_norm, BLOCK=triton.next_power_of_2(half), num_warps=1)
        return q
    except Exception as e:  # a compiler this kernel does not suit: the unfused ops, once and for all
        _qkv_fused_failed = True
        log.warning("fused q/k/v norm + RoPE + KV store kernel unavailable (%s: %s); using separate kernels",
                    type(e).__name__, str(e).strip().splitlines()[-1][:300] if str(e).strip() else "")
    return None


_qkv_fused_failed = False


_route_mod: list = []  # [hybridmoe.cpu.route, or None where the native library does not load]


def _native_route():
    """hybridmoe.cpu.route when the CPU engine's library loads here, else None (decided once)."""
    if not _route_mod:
        try:
            from hybridmoe.cpu import route

            route._lib()
            _route_mod.append(route)
        except Exception as e:  # not x86-64 Linux, no compiler for a source checkout, ...
            log.info("native CPU routing unavailable (%s: %s); using torch's ops", type(e).__name__, e)
            _route_mod.append(None)
    return _route_mod[0]


def topk_softmax(logits: torch.Tensor, k: int, renormalize: bool, num_warps: int = 4
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [T, K] float32 and expert ids [T, K] int32. CPU tensors: one native call
    (hybridmoe/cpu/route.py: topk_softmax_ref's ids, weights within a few fp32 ulps), the same routing
    as the one-call decoder layer's (cpu/layer_decode.py)."""
    t, e = logits.shape
    if logits.device.type == "cpu" and not use_triton(logits):
        route = _native_route()
        if route is not None and route.supports(logits, k):  # the CPU-only path: one native call, not 4 torch ops
            return route.topk_softmax_cpu(logits, k, renormalize)
        return topk_softmax_ref(logits, k, renormalize)
    if not use_triton(logits) or t == 0 or e > 4096:
        return topk_softmax_ref(logits, k, renormalize)
    logits = logits.contiguous()
    w = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int32, device=logits.device)
    _topk_softmax_kernel[(t,)](logits, w, ids, e, K=k, RENORM=renormalize, BLOCK=triton.next_power_of_2(e),
                               num_warps=num_warps)  # num_warps: benchmarks/bench_router.py
    return w, ids
