"""Dense gated MLP (SwiGLU): down(act(gate x) * up x)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str = "silu") -> None:
        super().__init__()
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (silu only)")
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
