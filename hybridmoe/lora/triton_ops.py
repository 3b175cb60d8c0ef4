"""Triton kernels of the batched LoRA (ops.py): shrink xa[t] = A[s] x[t] and expand
y[t] += scale[s] Bt[s]^T xa[t], s = idx[t] (-1: the token has no adapter and both kernels skip it).

Each program reads its token's slot from the index buffer, so a CUDA graph replays them for any
mix of adapters; per-token gather (decode batches are small; a prefill chunk reads each token's
A once per rank block). No host sync.

The shrink is split over K (`split_k`): at decode a single program per token looping over K
(2048 .. 4096) was a chain of dependent HBM loads, ~1 us each, the bulk of LoRA's cost per layer.
Each (token, K chunk) program writes a partial xa[t, c] and the expand sums the chunks as it loads
them (no third kernel, deterministic order).

Decode (few tokens, bf16/fp16 base weights: lora/linear.py's fused form) takes one kernel instead of
two: the slots' A rows are stacked under the base weight, so the base GEMM also yields every slot's
A x (the last S*R columns of its output), and `lora_expand_ext` writes y = base part + scale[s]
Bt[s]^T (A[s] x) for each token. At batch 1 the two small launches per linear were most of what an
attention LoRA added to a decode step on the H200 (about 18 us a layer for q/k/v and o).

Legend: T tokens, K in features, N out features, S slots, R max rank, C K chunks.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but keep the torch path importable
    triton = None

# programs the shrink aims at (an H200 has 132 SMs): more chunks per token for small T
_SHRINK_PROGRAMS = 256
_TILE = 4096  # A elements a shrink program loads per step (BLOCK_R x BLOCK_K)


def available() -> bool:
    return triton is not None


def split_k(t: int, k: int, block_r: int) -> tuple[int, int, int]:
    """(BLOCK_K, chunk length, chunks) of a shrink over t rows of K inputs: chunks of whole
    BLOCK_K steps, as many as keep about _SHRINK_PROGRAMS programs busy (1 for a long prefill)."""
    block_k = max(32, min(256, _TILE // block_r))
    steps = -(-k // block_k)
    chunks = max(1, min(steps, -(-_SHRINK_PROGRAMS // max(t, 1))))
    per = -(-steps // chunks) * block_k
    return block_k, per, -(-k // per)


if triton is not None:
    @triton.jit
    def _shrink(x_ptr, a_ptr, idx_ptr, xa_ptr, K, R, K_PER, stride_xt, stride_as, stride_ar, stride_xat,
                BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        t = tl.program_id(0)
        c = tl.program_id(1)
        s = tl.load(idx_ptr + t).to(tl.int64)
        if s < 0:  # the expand skips the token: nothing to write
            return
        offs_r = tl.arange(0, BLOCK_R)
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        k_beg = c * K_PER
        for k0 in range(0, K_PER, BLOCK_K):
            offs_k = k_beg + k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + t * stride_xt + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + s * stride_as + offs_r[:, None] * stride_ar + offs_k[None, :],
                        mask=(offs_r[:, None] < R) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(a * xv[None, :], axis=1)
        tl.store(xa_ptr + t * stride_xat + c * R + offs_r, acc, mask=offs_r < R)

    @triton.jit
    def _expand(xa_ptr, b_ptr, scale_ptr, idx_ptr, y_ptr, N, R, C, stride_xat, stride_bs, stride_br, stride_yt,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr):
        t = tl.program_id(0)
        nb = tl.program_id(1)
        s = tl.load(idx_ptr + t).to(tl.int64)
        if s < 0:
            return
        offs_r = tl.arange(0, BLOCK_R)
        offs_c = tl.arange(0, BLOCK_C)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        part = tl.load(xa_ptr + t * stride_xat + offs_c[:, None] * R + offs_r[None, :],
                       mask=(offs_c[:, None] < C) & (offs_r[None, :] < R), other=0.0)  # [BLOCK_C, BLOCK_R]
        xa = tl.sum(part, axis=0) * tl.load(scale_ptr + s)  # [BLOCK_R]
        b = tl.load(b_ptr + s * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :],
                    mask=(offs_r[:, None] < R) & (offs_n[None, :] < N), other=0.0).to(tl.float32)
        d = tl.sum(b * xa[:, None], axis=0)  # [BLOCK_N]
        yp = y_ptr + t * stride_yt + offs_n
        y = tl.load(yp, mask=offs_n < N, other=0.0)
        tl.store(yp, (y.to(tl.float32) + d).to(y.dtype), mask=offs_n < N)


    @triton.jit
    def _expand_ext(ye_ptr, b_ptr, scale_ptr, idx_ptr, y_ptr, N, R, stride_yet, stride_bs, stride_br, stride_yt,
                    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
        t = tl.program_id(0)
        nb = tl.program_id(1)
        s = tl.load(idx_ptr + t).to(tl.int64)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        row = ye_ptr + t * stride_yet
        y = tl.load(row + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        if s >= 0:
            offs_r = tl.arange(0, BLOCK_R)
            # this slot's A x: columns N + s R .. of the extended GEMM's row
            xa = tl.load(row + N + s * R + offs_r, mask=offs_r < R, other=0.0).to(tl.float32) * tl.load(scale_ptr + s)
            b = tl.load(b_ptr + s * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :],
                        mask=(offs_r[:, None] < R) & (offs_n[None, :] < N), other=0.0).to(tl.float32)
            y += tl.sum(b * xa[:, None], axis=0)
        tl.store(y_ptr + t * stride_yt + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)


def lora_expand_ext(y_ext: torch.Tensor,  # [T, N + S*R] base outputs, then every slot's A x
                    n: int,
                    Bt: torch.Tensor,  # [S, R, N]
                    scale: torch.Tensor,  # [S] float32
                    idx: torch.Tensor,  # [T] int32/int64
                    ) -> torch.Tensor:  # [T, N], dtype of y_ext
    """y[t] = y_ext[t, :N] + scale[s] Bt[s]^T y_ext[t, N + s R : N + (s + 1) R], s = idx[t] (-1: the base
    part alone)."""
    t = y_ext.shape[0]
    s, r, nb = Bt.shape
    assert nb == n and y_ext.shape[1] == n + s * r and y_ext.stride(1) == 1 and Bt.stride(2) == 1
    y = torch.empty(t, n, dtype=y_ext.dtype, device=y_ext.device)
    if t == 0:
        return y
    block_n = 64
    _expand_ext[(t, triton.cdiv(n, block_n))](y_ext, Bt, scale, idx, y, n, r, y_ext.stride(0), Bt.stride(0),
                                              Bt.stride(1), y.stride(0), BLOCK_R=max(16, triton.next_power_of_2(r)),
                                              BLOCK_N=block_n)
    return y


def lora_add(y: torch.Tensor,  # [T, N], updated in place
             x: torch.Tensor,  # [T, K]
             A: torch.Tensor,  # [S, R, K]
             Bt: torch.Tensor,  # [S, R, N]
             scale: torch.Tensor,  # [S] float32
             idx: torch.Tensor,  # [T] int32/int64
             ) -> torch.Tensor:
    t, k = x.shape
    if t == 0:
        return y
    r, n = A.shape[1], Bt.shape[2]
    assert x.stride(1) == 1 and A.stride(2) == 1 and Bt.stride(2) == 1 and y.stride(1) == 1
    block_r = max(16, triton.next_power_of_2(r))
    block_k, per, chunks = split_k(t, k, block_r)
    xa = torch.empty(t, chunks, r, dtype=torch.float32, device=x.device)  # [T, C, R] partial sums
    _shrink[(t, chunks)](x, A, idx, xa, k, r, per, x.stride(0), A.stride(0), A.stride(1), xa.stride(0),
                         BLOCK_R=block_r, BLOCK_K=block_k)
    block_n = 64
    _expand[(t, triton.cdiv(n, block_n))](xa, Bt, scale, idx, y, n, r, chunks, xa.stride(0), Bt.stride(0),
                                          Bt.stride(1), y.stride(0), BLOCK_R=block_r,
                                          BLOCK_C=triton.next_power_of_2(chunks), BLOCK_N=block_n)
    return y
