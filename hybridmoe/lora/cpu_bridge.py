"""The one place that talks to the native CPU experts engine about LoRA (the CPU share of a
layer's experts). The interface (hybridmoe/cpu/engine.py, built with the native LoRA kernels):
    attach_lora(layer_index, slots, max_rank)
    set_lora_slot(layer_index, slot, gate_A, gate_B, up_A, up_B, down_A, down_B, scaling)
        tensors [E, r, H], [E, I, r], [E, r, H], [E, I, r], [E, r, I], [E, H, r] (the layer's CPU experts)
    clear_lora_slot(layer_index, slot)
    forward/submit(..., lora_idx=int32 [T])   (-1: no adapter)
Until that is in the tree, an adapter with expert weights on CPU-resident experts is refused at load.
"""

from __future__ import annotations

import torch

from hybridmoe.lora.adapter import ExpertLoRA, LoRAAdapterError

NEEDS_NATIVE = "expert LoRA on CPU experts needs the native LoRA kernels"


def supported(cpu_layer) -> bool:
    """Whether the CPU engine layer takes LoRA slots."""
    return all(hasattr(cpu_layer, n) for n in ("attach_lora", "set_lora_slot", "clear_lora_slot"))


class CPUExpertLoRA:
    """The CPU share of one layer: rows are the layer's CPU experts' global ids, in the engine's order."""

    def __init__(self, cpu_layer, layer_idx: int, rows: torch.Tensor, slots: int, rank: int) -> None:
        if not supported(cpu_layer):
            raise LoRAAdapterError(f"layer {layer_idx}: {NEEDS_NATIVE} (put every expert on the GPU side, or serve "
                                   "adapters without expert weights)")
        self.layer, self.layer_idx, self.rows = cpu_layer, layer_idx, rows.long().cpu()
        cpu_layer.attach_lora(layer_idx, slots, rank)

    def set_slot(self, slot: int, lora: ExpertLoRA) -> None:
        parts = [t[self.rows].contiguous() for t in lora.tensors()]
        self.layer.set_lora_slot(self.layer_idx, slot, *parts, lora.scaling)

    def clear_slot(self, slot: int) -> None:
        self.layer.clear_lora_slot(self.layer_idx, slot)
