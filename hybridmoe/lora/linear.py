"""A linear layer with batched LoRA deltas: y = base(x) + per token, its slot's s * B (A x).

Wraps the model's own linear module (nn.Linear, Fp8Linear) after loading, so models keep
composing plain layers. A fused linear (qkv_proj) has one LoRA part per checkpoint module (q, k,
v): part p's A fills rows [p*R, (p+1)*R) of the slot's A and its B the same rows of Bt and only its
own output columns, i.e. a block-diagonal expand; one shrink and one expand launch for the three.

Fused form (CUDA, a plain nn.Linear whose weight has the slots' dtype, every slot's A at most 1/8 of
the weight's rows): the A buffer is the tail of an extended weight [N + S*P*R, K] whose head is the
base weight, so a forward of at most FUSED_MAX_T tokens is one GEMM (base outputs and every slot's
A x together) and one expand kernel (triton_ops.lora_expand_ext): one launch instead of two per
linear. Longer forwards (prefill) take the base weight alone, the shrink and the expand.

Legend: T tokens, K in features, N out features, S slots, R max rank, P parts.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe import envs
from hybridmoe.lora.batch import LoRABatch
from hybridmoe.lora.ops import add_lora

FUSED_MAX_T = 512  # tokens: decode and short extends (above, the other slots' A x is wasted GEMM work)
FUSED_MAX_EXTRA = 1 / 8  # the stacked A rows, as a share of the base weight's rows (the GEMM's extra reads)


def can_fuse(base: nn.Module, slot_rows: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `base` can take the fused form (see the module docstring)."""
    if device.type != "cuda" or type(base) is not nn.Linear or base.weight.dtype != dtype or not envs.lora_fused():
        return False
    if dtype not in (torch.bfloat16, torch.float16) or slot_rows > base.out_features * FUSED_MAX_EXTRA:
        return False
    from hybridmoe.lora import triton_ops

    return triton_ops.available()


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, in_features: int, parts: tuple[int, ...], slots: int, rank: int,
                 batch: LoRABatch, dtype: torch.dtype, device: torch.device, fused: bool | None = None) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.parts, self.rank = in_features, parts, rank
        self.out_features = sum(parts)
        self.offsets = [sum(parts[:i]) for i in range(len(parts))]
        p = len(parts)
        self.batch = [batch]  # a list: not a submodule
        # fixed slot buffers (graphs read them); plain attributes, not in the state dict
        self.fused = can_fuse(base, slots * p * rank, dtype, device) if fused is None else fused
        self.w_ext = self.b_ext = None
        if self.fused:  # [N + S*P*R, K]: the base weight, then every slot's A (lora_A is a view of the tail)
            n = self.out_features
            w = base.weight
            ext = torch.zeros(n + slots * p * rank, in_features, dtype=w.dtype, device=w.device)
            ext[:n].copy_(w.detach())
            base.weight = nn.Parameter(ext[:n], requires_grad=False)
            self.w_ext = ext
            self.lora_A = ext[n:].view(slots, p * rank, in_features)  # [S, P*R, K]
            if base.bias is not None:
                self.b_ext = torch.cat([base.bias.detach(), ext.new_zeros(slots * p * rank)])
        else:
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
        extra = self.b_ext.nbytes if self.b_ext is not None else 0
        return self.lora_A.nbytes + self.lora_Bt.nbytes + self.lora_scale.nbytes + extra

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
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.fused and x2.shape[0] <= FUSED_MAX_T:
            from hybridmoe.lora import triton_ops

            y_ext = torch.nn.functional.linear(x2, self.w_ext, self.b_ext)  # [T, N + S*P*R]
            y2 = triton_ops.lora_expand_ext(y_ext, self.out_features, self.lora_Bt, self.lora_scale,
                                            self.batch[0].index(x2.shape[0]))
            return y2.reshape(*lead, self.out_features)
        y = self.base(x)
        y2 = y.reshape(-1, self.out_features)
        add_lora(y2, x2, self.lora_A, self.lora_Bt, self.lora_scale, self.batch[0].index(x2.shape[0]))
        return y2.reshape(*lead, self.out_features)
