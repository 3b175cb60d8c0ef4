"""The typed settings every MoE experts backend factory receives (instead of a dict of flags)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hybridmoe.config import HybridConfig

if TYPE_CHECKING:
    from hybridmoe.cpu.engine import CPUThreadPool
    from hybridmoe.cpu.quant import PackedLayer
    from hybridmoe.moe.runtime import HybridRuntime
    from hybridmoe.moe.triton_moe_kernels import MoEKernelConfig


@dataclass(frozen=True)
class ExpertsOptions:
    """Engine-level settings of one layer's experts backend.

    device: where the model runs. hybrid: the --kt-* options (CPU method, threads, NUMA, INT4
    group size). packed: the layer's CPU experts as read from --kt-weight-path (not quantized
    again). pack_device: where quantization runs (the GPU for random benchmark weights). page_align:
    give every packed CPU tensor pages of its own (page-locked in place for the layerwise prefill).
    pool: the CPU engine's thread pool. runtime: the hybrid layers' shared runtime (hybrid backend
    only). triton_config: forced tile sizes of the Triton backend (tests, sweeps). cpu_isa: force a
    CPU kernel ISA (tests). dtype: the model's compute dtype, which backends that do not compute in
    fp8 dequantize block-scaled fp8 experts to (None: bf16 on CUDA, fp32 on the CPU).
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    hybrid: HybridConfig = field(default_factory=HybridConfig)
    packed: PackedLayer | None = None
    pack_device: torch.device | None = None
    page_align: bool = False
    pool: CPUThreadPool | None = None
    runtime: HybridRuntime | None = None
    triton_config: MoEKernelConfig | None = None
    cpu_isa: str | None = None
    dtype: torch.dtype | None = None

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        """`dtype`, or the engine's default for `device` when unset."""
        return self.dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
