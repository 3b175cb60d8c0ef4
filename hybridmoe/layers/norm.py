"""RMSNorm, computed in float32 like the reference implementations (fused kernel on CUDA)."""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe.layers.fused_ops import add_rmsnorm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size]
        shape = x.shape
        out, _ = add_rmsnorm(x.reshape(-1, shape[-1]), None, self.weight, self.eps)
        return out.view(shape)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one pass. x, residual: [T, size]."""
        return add_rmsnorm(x, residual, self.weight, self.eps)
