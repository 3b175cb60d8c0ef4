"""The "cpu" MoE experts backend: routed experts quantized at construction, computed by the CPU engine.

Legend: T tokens, H hidden, E experts, K top-k.

Options (engine-level, KTransformers names): kt_method (AMXINT8 | AMXINT4 | BF16, default AMXINT8),
kt_cpuinfer (threads; None = physical cores - 1), kt_threadpool_count (sub-pools, one per NUMA node),
kt_numa_nodes ("0,1": only those nodes' cores, one sub-pool per node at least),
group_size (int4, default 128), int4_symmetric (default True), cpu_isa (avx2 | avx512 | amx; default
$HYBRIDMOE_CPU_ISA or the best present), packed (a PackedLayer loaded from --kt-weight-path instead
of quantizing the given weights), pack_device (where quantization runs; the runner picks the GPU
for `--load-format dummy` benchmarks), page_align (give every packed tensor pages of its own, so it
can be page-locked in place: the hybrid layer's layerwise GPU prefill).
"""

from __future__ import annotations

import torch

from hybridmoe.cpu.engine import CPUMoELayer, default_pool
from hybridmoe.cpu.quant import PackedLayer, pack_layer, page_aligned_layer
from hybridmoe.cpu.topology import parse_node_list
from hybridmoe.moe.experts import ExpertWeights, MoEExperts, register_experts_backend


class CPUExperts(MoEExperts):
    name = "cpu"

    def __init__(self, weights: ExpertWeights | None, layer_idx: int, options: dict):
        self.layer_idx = layer_idx
        method = (options.get("kt_method") or "AMXINT8").upper()
        packed: PackedLayer | None = options.get("packed")
        if packed is None:
            if weights is None:
                raise ValueError("CPUExperts needs weights or a packed layer")
            packed = pack_layer(
                weights.gate_up,
                weights.down,
                method,
                group_size=int(options.get("group_size") or 128),
                symmetric=bool(options.get("int4_symmetric", True)),
                activation=weights.activation,
                device=options.get("pack_device"),
                page_align=bool(options.get("page_align")),
            )
        if options.get("page_align"):  # to be page-locked in place for the layerwise GPU prefill
            packed = page_aligned_layer(packed)  # copies only tensors that do not own their pages yet
        nodes = options.get("kt_numa_nodes")
        pool = default_pool(options.get("kt_cpuinfer"), int(options.get("kt_threadpool_count") or 1),
                            parse_node_list(nodes) if nodes else None)
        self.layer = CPUMoELayer(packed, isa=options.get("cpu_isa"), pool=pool)
        self.method = packed.method

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, K] int
        topk_weights: torch.Tensor,  # [T, K] float32
    ) -> torch.Tensor:  # [T, H], dtype and device of x
        out = self.layer.forward(x, topk_ids, topk_weights)
        return out.to(device=x.device, dtype=x.dtype)

    # asynchronous use (the hybrid GPU+CPU layer): see CPUMoELayer.submit / sync
    def submit(self, x, topk_ids, topk_weights, out, accumulate=False, skip_mask=None) -> int:
        return self.layer.submit(x, topk_ids, topk_weights, out, accumulate, skip_mask)

    def sync(self, task_id: int | None = None, max_pending: int = 0) -> None:
        self.layer.sync(task_id, max_pending)


@register_experts_backend("cpu")
def make_cpu_experts(weights: ExpertWeights, layer_idx: int, options: dict) -> MoEExperts:
    return CPUExperts(weights, layer_idx, options)
