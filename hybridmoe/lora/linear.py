"""A linear layer with batched LoRA deltas: y = base(x) + per token, its slot's s * B (A x).

Wraps the model's own linear module (nn.Linear, Fp8Linear) after loading, so models keep
composing plain layers. A fused linear (qkv_proj) has one LoRA part per checkpoint module (q, k,
v): part p's A fills rows [p*R, (p+1)*R) of the slot's A and its B the same rows of Bt and only its
own output columns, i.e. a block-diagonal expand; one shrink and one expand launch for the three.

Legend: T tokens, K in features, N out features, S slots, R max rank, P parts.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe.lora.batch import LoRABatch
from hybridmoe.lora.ops import add_lora


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, in_features: int, parts: tuple[int, ...], slots: int, rank: int,
                 batch: LoRABatch, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.parts, self.rank = in_features, parts, rank
        self.out_features = sum(parts)
        self.offsets = [sum(parts[:i]) for i in range(len(parts))]
        p = len(parts)
        self.batch = [batch]  # a list: not a submodule
        # fixed slot buffers (graphs read them); plain attributes, not in the state dict
        self.lora_A = torch.zeros(slots, p * rank, in_features, dtype=dtype, device=device)  # [S, P*R, K]
        self.lora_Bt = torch.zeros(slots, p * rank, self.out_features, dtype=dtype, device=device)  # [S, P*R, N]
        self.lora_scale = torch.zeros(slots, dtype=torch.float32, device=device)  # [S]

    @property
    def weight(self) -> torch.Tensor:  # code that reads the base weight (fp8 loading, tests)
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.base, "bias", None)

    def nbytes(self) -> int:
        return self.lora_A.nbytes + self.lora_Bt.nbytes + self.lora_scale.nbytes

    def set_slot(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        """Copy an adapter into `slot`: part index -> (A [r, K], B [n_part, r], scaling); parts left
        out get zeros. Different scalings per part are folded into B (one scale per slot)."""
        self.clear_slot(slot)
        if not parts:
            return
        scalings = {s for _, _, s in parts.values()}
        fold = len(scalings) > 1
        r = self.rank
        for p, (a, b, s) in parts.items():
            k = a.shape[0]
            self.lora_A[slot, p * r:p * r + k].copy_(a)
            bt = b.t() * s if fold else b.t()
            o, n = self.offsets[p], self.parts[p]
            self.lora_Bt[slot, p * r:p * r + k, o:o + n].copy_(bt)
        self.lora_scale[slot] = 1.0 if fold else scalings.pop()

    def clear_slot(self, slot: int) -> None:
        self.lora_A[slot].zero_()
        self.lora_Bt[slot].zero_()
        self.lora_scale[slot] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        y = self.base(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        y2 = y.reshape(-1, self.out_features)
        add_lora(y2, x2, self.lora_A, self.lora_Bt, self.lora_scale, self.batch[0].index(x2.shape[0]))
        return y2.reshape(*lead, self.out_features)
