"""Pure-torch routed experts: gathers each (token, slot) pair's expert weights and runs batched
matmuls, in bounded chunks. No Python loop over experts, no host sync; portable (CPU, GPU) and
the engine's reference path.

Legend: T tokens, K top-k, N = T*K pairs, H hidden, I intermediate, E experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmoe.moe.experts import ExpertWeights, MoEExperts
from hybridmoe.moe.options import ExpertsOptions

_MAX_GATHER_ELEMS = 1 << 26  # bound on gathered weight elements per chunk (memory, not speed)


def _activate(gate_up: torch.Tensor, activation: str) -> torch.Tensor:  # [N, 2I] -> [N, I]
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate) * up
    raise ValueError(f"unsupported expert activation {activation!r}")


class TorchExperts(MoEExperts):
    """Block-scaled fp8 experts are dequantized once, at construction, to `dtype` (the reference
    path: exact dequantized weights, ExpertWeights.dequantized)."""

    name = "torch"

    def __init__(self, weights: ExpertWeights, dtype: torch.dtype | None = None) -> None:
        if weights.is_fp8:
            weights = weights.dequantized(dtype or torch.float32)
        self.w = weights
        self.lora = None  # lora/experts.py ExpertLoRASlots: per-token adapter deltas (attached by the LoRA manager)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        t, h = x.shape
        k = topk_ids.shape[1]
        out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
        if t == 0:
            return out.to(x.dtype)
        ids = topk_ids.reshape(-1).long()  # [N]
        tok = torch.arange(t, device=x.device).repeat_interleave(k)  # [N]
        wts = topk_weights.reshape(-1).float()  # [N]
        per_pair = self.w.gate_up.shape[1] * h + self.w.down.shape[1] * self.w.down.shape[2]
        step = max(1, _MAX_GATHER_ELEMS // per_pair)
        lora = self.lora
        for s in range(0, ids.numel(), step):
            e, tk = ids[s:s + step], tok[s:s + step]
            xs = x[tk].unsqueeze(-1)  # [n, H, 1]
            gu = torch.bmm(self.w.gate_up[e], xs).squeeze(-1)  # [n, 2I]
            if lora is not None:  # the adapters' deltas before the activation
                slot, scale = lora.pair_slots(t, tk)
                gu = gu + lora.gate_up(xs.squeeze(-1), e, slot, scale)
            act = _activate(gu, self.w.activation)
            y = torch.bmm(self.w.down[e], act.unsqueeze(-1)).squeeze(-1)  # [n, H]
            if lora is not None:  # and after down
                y = y + lora.down(act, e, slot, scale)
            out.index_add_(0, tk, y.float() * wts[s:s + step, None])
        return out.to(x.dtype)


def make_torch_experts(weights: ExpertWeights, layer_idx: int, options: ExpertsOptions) -> MoEExperts:
    return TorchExperts(weights, options.compute_dtype(weights.gate_up.device))
