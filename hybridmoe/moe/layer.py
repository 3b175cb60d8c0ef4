"""The sparse MoE block of a decoder layer: router, routed experts (through the MoEExperts
interface), and an optional shared expert with a sigmoid gate (Qwen2-MoE style).

Legend: T tokens, H hidden, E experts, K top-k.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe.layers.mlp import GatedMLP
from hybridmoe.moe.experts import MoEExperts
from hybridmoe.moe.router import topk_softmax


class SparseMoEBlock(nn.Module):
    def __init__(
        self,
        layer_idx: int,
        hidden: int,
        num_experts: int,
        top_k: int,
        intermediate: int,
        renormalize: bool,
        shared_intermediate: int = 0,
        gate_name: str = "gate",
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_experts, self.top_k, self.intermediate = num_experts, top_k, intermediate
        self.renormalize = renormalize
        self.gate_name = gate_name
        self.add_module(gate_name, nn.Linear(hidden, num_experts, bias=False))
        if shared_intermediate > 0:
            self.shared_expert = GatedMLP(hidden, shared_intermediate)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.has_shared = shared_intermediate > 0
        self.experts: MoEExperts | None = None  # set by the loader once the weights are read

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        assert self.experts is not None, "expert weights were not loaded"
        logits = getattr(self, self.gate_name)(x)  # [T, E]
        weights, ids = topk_softmax(logits, self.top_k, self.renormalize)  # [T, K]
        out = self.experts.forward(x, ids, weights)
        if self.has_shared:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
