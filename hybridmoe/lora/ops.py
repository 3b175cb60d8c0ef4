"""Batched LoRA for a linear: for every token t with slot s = idx[t] (-1: no adapter),
    y[t] += scale[s] * Bt[s]^T (A[s] x[t]).

The slot buffers are fixed tensors (loading an adapter copies into them), so a CUDA graph that
reads them and the per-token index buffer stays valid across loads. Ranks below the buffer's R
are zero-padded: the padding contributes nothing.

torch path (the CPU device, and CUDA without Triton): dense over slots, two GEMMs with S*R inner
width and a [T, S] mask; no gather of per-token weights, no Python loop over adapters, no host
sync. Triton path (CUDA): per-token gather kernels (triton_ops.py).

Legend: T tokens, K in features, N out features, S slots, R max rank.
"""

from __future__ import annotations

import torch


def lora_delta_ref(x: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor, scale: torch.Tensor,
                   idx: torch.Tensor) -> torch.Tensor:
    """The obvious loop over tokens (tests' oracle), in float64. Returns [T, N]."""
    out = torch.zeros(x.shape[0], Bt.shape[2], dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        s = int(idx[t])
        if s >= 0:
            out[t] = float(scale[s]) * (Bt[s].double().t() @ (A[s].double() @ x[t].double()))
    return out


def lora_delta_torch(x: torch.Tensor,  # [T, K]
                     A: torch.Tensor,  # [S, R, K]
                     Bt: torch.Tensor,  # [S, R, N]
                     scale: torch.Tensor,  # [S] float32
                     idx: torch.Tensor,  # [T] int: slot per token, -1 none
                     ) -> torch.Tensor:  # [T, N], dtype of x
    t = x.shape[0]
    s, r, k = A.shape
    xa = x @ A.reshape(s * r, k).t()  # [T, S*R]
    mask = (idx.long()[:, None] == torch.arange(s, device=x.device)[None, :]).to(torch.float32) * scale[None, :]
    xa = (xa.view(t, s, r) * mask.to(xa.dtype)[:, :, None]).reshape(t, s * r)
    return xa @ Bt.reshape(s * r, Bt.shape[2])


def add_lora(y: torch.Tensor,  # [T, N] the base output, updated in place
             x: torch.Tensor,  # [T, K]
             A: torch.Tensor, Bt: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """y += the LoRA deltas; returns y. Triton on CUDA, torch elsewhere."""
    if x.shape[0] == 0:
        return y
    if y.is_cuda:
        from hybridmoe.lora import triton_ops

        if triton_ops.available():
            triton_ops.lora_add(y, x, A, Bt, scale, idx)
            return y
    y += lora_delta_torch(x, A, Bt, scale, idx).to(y.dtype)
    return y
