"""The per-token slot index every LoRA-wrapped module of a model reads during a forward.

Eager forwards set `current` to a fresh [T] int32 tensor; CUDA-graph decode reads the fixed
`graph_index` buffer (captured once, rewritten before each replay), so loading or unloading an
adapter never needs a recapture.

Legend: T tokens, B graph batch size.
"""

from __future__ import annotations

import torch


class LoRABatch:
    """Where the wrapped modules find each token's slot (-1: the base model)."""

    def __init__(self, device: torch.device, graph_capacity: int = 0) -> None:
        self.device = device
        self.graph_index = torch.full((max(1, graph_capacity),), -1, dtype=torch.int32, device=device)  # [B]
        self.current = torch.full((0,), -1, dtype=torch.int32, device=device)  # [T]
        self.expert_tokens = False  # host-side: some token's adapter has expert weights (set by the manager)

    def set(self, per_token: list[int]) -> None:
        """An eager forward's slots, one per new token."""
        self.current = torch.tensor(per_token, dtype=torch.int32).to(self.device, non_blocking=True)

    def set_graph(self, bs: int) -> None:
        """A graph's forward of bs rows reads the fixed buffer (capture and replay)."""
        self.current = self.graph_index[:bs]

    def index(self, t: int) -> torch.Tensor:  # [t] int32
        """The slots of a forward of t tokens; none set (or another size): every token the base model."""
        cur = self.current
        if cur.shape[0] == t:
            return cur
        return torch.full((t,), -1, dtype=torch.int32, device=self.device)
