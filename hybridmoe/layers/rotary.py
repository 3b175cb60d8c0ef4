"""Rotary position embedding (rotate-half layout, as Llama/Qwen/Mixtral checkpoints use)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables [max_position, D/2] (float32); layers/fused_ops.py applies them.

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


def rope_theta_of(config: object) -> float:
    """rope_theta from a transformers config of either generation (4.x field or 5.x rope_parameters)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if rope_type not in ("default", None):
        raise ValueError(f"config.json: rope type {rope_type!r} is not supported yet (only the default RoPE)")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(config, "rope_theta", 10000.0))
