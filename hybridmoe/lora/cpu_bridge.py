"""The one place that talks to the native CPU experts engine about LoRA (the CPU share of a
layer's experts). The interface (hybridmoe/cpu/engine.py CPUMoELayer, native kernels csrc/lora.h):
    attach_lora(layer_index, slots, max_rank, dtype)
    set_lora_slot(layer_index, slot, gate_A, gate_B, up_A, up_B, down_A, down_B, scaling)
        tensors [E, r, H], [E, I, r], [E, r, H], [E, I, r], [E, r, I], [E, H, r] (the layer's CPU experts)
    clear_lora_slot(layer_index, slot)
    forward/submit(..., lora_idx=int32 [T])   (-1: no adapter)
The hybrid layer (moe/hybrid.py) and the all-CPU backend (moe/cpu_experts.py) pass each task the
tokens' slots from `batch` (lora/batch.py).
"""

from __future__ import annotations

import torch

from hybridmoe.lora.adapter import ExpertLoRA, LoRAAdapterError
from hybridmoe.lora.batch import LoRABatch

NEEDS_NATIVE = "expert LoRA on CPU experts needs the native LoRA kernels"


def supported(cpu_layer) -> bool:
    """Whether the CPU engine layer takes LoRA slots."""
    return all(hasattr(cpu_layer, n) for n in ("attach_lora", "set_lora_slot", "clear_lora_slot"))


def slot_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """Host slot weights: fp32 for an fp32 model (exact adapters), else bf16 (half the memory)."""
    return torch.float32 if model_dtype == torch.float32 else torch.bfloat16


class CPUExpertLoRA:
    """The CPU share of one layer: rows are the layer's CPU experts' global ids, in the engine's order."""

    def __init__(self, cpu_layer, layer_idx: int, rows: torch.Tensor, slots: int, rank: int,
                 batch: LoRABatch | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
        if not supported(cpu_layer):
            raise LoRAAdapterError(f"layer {layer_idx}: {NEEDS_NATIVE} (put every expert on the GPU side, or serve "
                                   "adapters without expert weights)")
        self.layer, self.layer_idx, self.rows = cpu_layer, layer_idx, rows.long().cpu()
        self.batch = batch
        try:
            cpu_layer.attach_lora(layer_idx, slots, rank, dtype)
        except ValueError as e:
            raise LoRAAdapterError(str(e)) from e

    def set_slot(self, slot: int, lora: ExpertLoRA) -> None:
        parts = [t[self.rows].contiguous() for t in lora.tensors()]
        self.layer.set_lora_slot(self.layer_idx, slot, *parts, lora.scaling)

    def clear_slot(self, slot: int) -> None:
        self.layer.clear_lora_slot(self.layer_idx, slot)

    def nbytes(self) -> int:
        """Host bytes of the slot buffers (the startup memory plan's CPU share line)."""
        return self.layer.lora.nbytes()

    def index(self, t: int) -> torch.Tensor:  # [t] int32 on the batch's device
        """The slots of a forward's t tokens (every token -1 without a batch)."""
        if self.batch is None:
            return torch.full((t,), -1, dtype=torch.int32)
        return self.batch.index(t)
