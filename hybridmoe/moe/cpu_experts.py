"""The "cpu" MoE experts backend: routed experts quantized at construction, computed by the CPU engine.

Legend: T tokens, H hidden, E experts, K top-k.

Settings come typed (ExpertsOptions): hybrid.method (AMXINT8 | AMXINT4 | BF16 | FP8), hybrid.cpuinfer
(threads; None = physical cores - 1), hybrid.threadpool_count (sub-pools, one per NUMA node),
hybrid.numa_nodes (only those nodes' cores), hybrid.group_size / int4_symmetric (INT4), hybrid.cpu
(CPUEngineSettings of the pool), pool (an existing pool; default: the process-wide one), packed (a
PackedLayer loaded from --kt-weight-path instead of quantizing the given weights), pack_device
(where quantization runs), page_align (every packed tensor on pages of its own, so it can be
page-locked in place: the hybrid layer's layerwise GPU prefill), cpu_isa (force a kernel ISA).

Block-scaled fp8 weights (ExpertWeights.is_fp8, a DeepSeek-V3 checkpoint): FP8 keeps their bytes (1 byte
per weight plus block scales, no conversion step); the other methods dequantize them a few experts at
a time and quantize those (never the whole layer in fp32).
"""

from __future__ import annotations

import torch

from hybridmoe.config import HybridConfig
from hybridmoe.cpu.engine import CPUMoELayer, CPUThreadPool, default_pool
from hybridmoe.cpu.gguf_engine import GGUFExperts, GGUFMoELayer
from hybridmoe.cpu.pack import NonFiniteWeights, pack_layer  # native quantizers (the torch reference elsewhere)
from hybridmoe.cpu.quant import PackedLayer, page_aligned_layer
from hybridmoe.moe.experts import ExpertWeights, MoEExperts
from hybridmoe.moe.options import ExpertsOptions
from hybridmoe.weights.loader import CheckpointError


def cpu_pool_for(cfg: HybridConfig) -> CPUThreadPool:
    """The process-wide CPU engine pool for these --kt-* settings (created on first use)."""
    return default_pool(cfg.cpuinfer, cfg.threadpool_count, list(cfg.numa_nodes) if cfg.numa_nodes else None,
                        settings=cfg.cpu)


class CPUExperts(MoEExperts):
    name = "cpu"

    def __init__(self, weights: ExpertWeights | None, layer_idx: int, options: ExpertsOptions) -> None:
        self.layer_idx = layer_idx
        self.lora = None  # lora/cpu_bridge.py CPUExpertLoRA: per-token adapter slots (attached by the LoRA manager)
        cfg = options.hybrid
        packed: PackedLayer | None = options.packed
        if packed is None:
            if weights is None:
                raise ValueError("CPUExperts needs weights or a packed layer")
            try:
                packed = pack_layer(
                    weights.gate_up,
                    weights.down,
                    cfg.method.upper(),
                    group_size=cfg.group_size,
                    symmetric=cfg.int4_symmetric,
                    activation=weights.activation,
                    device=options.pack_device,
                    page_align=options.page_align,
                    fp8_scales=(weights.gate_up_scale, weights.down_scale) if weights.is_fp8 else None,
                    fp8_block=weights.block,
                    pool=options.pool,
                )
            except NonFiniteWeights as e:  # a damaged checkpoint: one line naming the layer, expert and row
                raise CheckpointError(f"layer {layer_idx} routed experts: {e}") from e
            except ValueError as e:  # bad fp8 blocks or NaN weights: say which layer
                raise ValueError(f"layer {layer_idx} routed experts: {e}") from e
        if isinstance(packed, GGUFExperts):  # --kt-method LLAMAFILE: the GGUF blocks themselves
            self.layer = GGUFMoELayer(packed, isa=options.cpu_isa, pool=options.pool or cpu_pool_for(cfg))
            self.method = packed.method
            return
        if options.page_align:  # to be page-locked in place for the layerwise GPU prefill
            packed = page_aligned_layer(packed)  # copies only tensors that do not own their pages yet
        pool = options.pool or cpu_pool_for(cfg)
        self.layer = CPUMoELayer(packed, isa=options.cpu_isa, pool=pool)
        self.method = packed.method

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, K] int
        topk_weights: torch.Tensor,  # [T, K] float32
    ) -> torch.Tensor:  # [T, H], dtype and device of x
        lora_idx = self.lora.index(x.shape[0]) if self.lora is not None else None
        out = self.layer.forward(x, topk_ids, topk_weights, lora_idx=lora_idx)
        return out.to(device=x.device, dtype=x.dtype)

    # asynchronous use (the hybrid GPU+CPU layer): see CPUMoELayer.submit / sync
    def submit(self, x, topk_ids, topk_weights, out, accumulate=False, skip_mask=None, lora_idx=None) -> int:
        return self.layer.submit(x, topk_ids, topk_weights, out, accumulate, skip_mask, lora_idx)

    def sync(self, task_id: int | None = None, max_pending: int = 0) -> None:
        self.layer.sync(task_id, max_pending)


def make_cpu_experts(weights: ExpertWeights, layer_idx: int, options: ExpertsOptions) -> MoEExperts:
    return CPUExperts(weights, layer_idx, options)
