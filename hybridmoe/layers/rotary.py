"""Rotary position embedding (rotate-half layout, as Llama/Qwen/Mixtral checkpoints use)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables; applies RoPE to q and k at given positions.

    Legend: T tokens, H heads, D head dim (rotary_dim == D).
    """

    def __init__(self, head_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_position, self.theta = head_dim, max_position, theta
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build()

    def build(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the tables, e.g. after the module was created on the meta device."""
        head_dim, max_position, theta = self.head_dim, self.max_position, self.theta
        # float32 throughout, as the checkpoints' reference implementation computes it
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
        t = torch.arange(max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)  # [max_position, D/2]
        self.cos, self.sin = freqs.cos(), freqs.sin()

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor  # [T], [T,Hq,D], [T,Hkv,D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same op order as the HF reference: x*cos + rotate_half(x)*sin in x's dtype.
    cos = torch.cat([cos, cos], dim=-1).to(x.dtype)
    sin = torch.cat([sin, sin], dim=-1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rope_theta_of(config: object) -> float:
    """rope_theta from a transformers config of either generation (4.x field or 5.x rope_parameters)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if rope_type not in ("default", None):
        raise ValueError(f"config.json: rope type {rope_type!r} is not supported yet (only the default RoPE)")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(config, "rope_theta", 10000.0))
