"""Triton kernels of the batched LoRA (ops.py): shrink xa[t] = scale[s] * A[s] x[t] and expand
y[t] += Bt[s]^T xa[t], s = idx[t] (-1: the token has no adapter and both kernels skip it).

Each program reads its token's slot from the index buffer, so a CUDA graph replays them for any
mix of adapters; per-token gather (decode batches are small; a prefill chunk reads each token's
A once per rank block). No host sync.

Legend: T tokens, K in features, N out features, S slots, R max rank.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but keep the torch path importable
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _shrink(x_ptr, a_ptr, scale_ptr, idx_ptr, xa_ptr, K, R, stride_xt, stride_as, stride_ar,
                BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        t = tl.program_id(0)
        s = tl.load(idx_ptr + t).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        if s < 0:
            tl.store(xa_ptr + t * R + offs_r, tl.zeros([BLOCK_R], dtype=tl.float32), mask=offs_r < R)
            return
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + t * stride_xt + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + s * stride_as + offs_r[:, None] * stride_ar + offs_k[None, :],
                        mask=(offs_r[:, None] < R) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(a * xv[None, :], axis=1)
        acc = acc * tl.load(scale_ptr + s)
        tl.store(xa_ptr + t * R + offs_r, acc, mask=offs_r < R)

    @triton.jit
    def _expand(xa_ptr, b_ptr, idx_ptr, y_ptr, N, R, stride_bs, stride_br, stride_yt,
                BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
        t = tl.program_id(0)
        nb = tl.program_id(1)
        s = tl.load(idx_ptr + t).to(tl.int64)
        if s < 0:
            return
        offs_r = tl.arange(0, BLOCK_R)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        xa = tl.load(xa_ptr + t * R + offs_r, mask=offs_r < R, other=0.0)
        b = tl.load(b_ptr + s * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :],
                    mask=(offs_r[:, None] < R) & (offs_n[None, :] < N), other=0.0).to(tl.float32)
        d = tl.sum(b * xa[:, None], axis=0)  # [BLOCK_N]
        yp = y_ptr + t * stride_yt + offs_n
        y = tl.load(yp, mask=offs_n < N, other=0.0)
        tl.store(yp, (y.to(tl.float32) + d).to(y.dtype), mask=offs_n < N)


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
    xa = torch.empty(t, r, dtype=torch.float32, device=x.device)  # [T, R]
    block_r = max(16, triton.next_power_of_2(r))
    _shrink[(t,)](x, A, scale, idx, xa, k, r, x.stride(0), A.stride(0), A.stride(1),
                  BLOCK_R=block_r, BLOCK_K=64)
    block_n = 64
    _expand[(t, triton.cdiv(n, block_n))](xa, Bt, idx, y, n, r, Bt.stride(0), Bt.stride(1), y.stride(0),
                                          BLOCK_R=block_r, BLOCK_N=block_n)
    return y
