"""GGUF experts in the layerwise GPU prefill (--kt-method LLAMAFILE with --kt-gpu-prefill-token-threshold):
what moe/layerwise.py streams and how it turns the streamed bytes back into dense experts.

Legend: Ec streamed experts of a layer, H hidden, I expert intermediate, RB bytes per row.

The streamed tensors are the CPU layer's own GGUF rows (gate, up [Ec, I, RB_h], down [Ec, H, RB_i]:
views of the memory-mapped file, or page-aligned copies where the CPU-resident experts were not one
contiguous run), copied as they are into a GPU staging slot; `dequantize_gguf_experts` then writes
them straight into the layer buffer with the Triton kernel (gguf/triton_dequant.py), no temporaries.
On the CPU device the same call runs the torch reference. The file's pages are page-locked read-only
(cuMemHostRegister's READ_ONLY flag: the mapping is PROT_READ) so the copies are DMA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridmoe.cpu.gguf_engine import GGUFExperts
from hybridmoe.gguf.triton_dequant import dequantize_into


@dataclass(frozen=True)
class GGUFFormat:
    """What the dequantization needs besides the streamed tensors: the three projections' types."""

    types: tuple[int, int, int]  # GGML type ids of gate, up, down
    hidden: int
    inter: int

    @classmethod
    def of(cls, x: GGUFExperts) -> GGUFFormat:
        return cls(tuple(x.types), x.hidden, x.inter)


def gguf_parts(x: GGUFExperts) -> dict[str, torch.Tensor]:
    """The tensors the prefill streams, [E, ...] with one expert per row."""
    return {"gate": x.gate, "up": x.up, "down": x.down}


def dequantize_gguf_experts(
    parts: dict[str, torch.Tensor],  # gguf_parts() rows of c experts, on the compute device
    fmt: GGUFFormat,
    gate_up: torch.Tensor,  # out [c, 2I, H]
    down: torch.Tensor,  # out [c, H, I]
) -> None:
    """c experts' GGUF rows -> dense gate_up (gate rows first) and down in their dtype: exactly the
    reference dequantization (cpu/gguf_quant.dequantize) rounded once to that dtype."""
    i = fmt.inter
    dequantize_into(parts["gate"], fmt.types[0], gate_up[:, :i])
    dequantize_into(parts["up"], fmt.types[1], gate_up[:, i:])
    dequantize_into(parts["down"], fmt.types[2], down)
