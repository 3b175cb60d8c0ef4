"""Hybrid routed experts: the layer's GPU-resident experts on the GPU backend, the rest on the CPU
engine, computed at the same time; optional deferral of each token's lowest-weight CPU experts
to the next MoE layer.

Legend: T tokens, H hidden, E experts of the layer, K top-k, Eg/Ec GPU/CPU experts.

Per forward: the CPU task is submitted first (returns at once), the GPU experts run meanwhile,
then the CPU result is waited for and added. With deferral d > 0, each token's d lowest-weight
CPU experts go into a second CPU task, queued after the first; its output is added to the next
MoE layer's output, so the CPU works through the next attention. The last MoE layer defers
nothing and collects what the one before it deferred.

Status: the CPU side is driven from Python here (submit/sync); enqueueing it on the CUDA stream
as host functions (so a decode step is capturable in a CUDA graph) is not built yet, so on CUDA
the runner turns CUDA graphs off for hybrid models.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from hybridmoe.config import ConfigError, EngineArgs
from hybridmoe.moe.experts import ExpertWeights, MoEExperts, create_experts, register_experts_backend
from hybridmoe.moe.placement import gpu_experts_per_layer, place_experts

log = logging.getLogger(__name__)


@dataclass
class _Deferred:
    experts: MoEExperts  # the CPU experts that own the task
    task: int
    out: torch.Tensor  # [T, H] float32 host


@dataclass
class HybridPlan:
    """The split of every MoE layer, decided once from the flags, shared by all layers."""

    masks: dict[int, torch.Tensor]  # layer -> [E] bool, True = on the GPU
    moe_layers: list[int]
    num_deferred: int
    gpu_backend: str
    device: torch.device
    pending: _Deferred | None = field(default=None, repr=False)  # deferred work of the previous layer

    @classmethod
    def from_args(cls, args: EngineArgs, hf_config, device: torch.device) -> HybridPlan | None:
        """None when no split is asked for (all experts on the GPU, or all on the CPU without deferral)."""
        from hybridmoe.models.registry import arch_spec

        if args.kt_num_gpu_experts is None and args.kt_gpu_experts_ratio is None:
            if args.kt_max_deferred_experts_per_token:
                raise ConfigError("--kt-max-deferred-experts-per-token needs CPU experts: set --kt-num-gpu-experts")
            return None
        for flag, value in (("--kt-gpu-prefill-token-threshold", args.kt_gpu_prefill_token_threshold),
                            ("--kt-enable-dynamic-expert-update", args.kt_enable_dynamic_expert_update)):
            if value:
                raise ConfigError(f"{flag} is not yet available")
        spec = arch_spec(hf_config)
        n_gpu = gpu_experts_per_layer(spec.num_experts, args.kt_num_gpu_experts, args.kt_gpu_experts_ratio)
        if n_gpu == 0 and not args.kt_max_deferred_experts_per_token:
            return None  # every expert on the CPU: the plain "cpu" backend
        try:
            masks = place_experts(args.kt_expert_placement_strategy, list(spec.moe_layers), spec.num_experts,
                                  n_gpu, args.init_expert_location, args.random_seed)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        gpu_backend = args.moe_backend if args.moe_backend in ("torch", "triton") else (
            "triton" if device.type == "cuda" else "torch")
        on_gpu = sum(int(m.sum()) for m in masks.values())
        log.info("hybrid experts: %d of %d routed experts on the %s (%s placement), the rest on the CPU; "
                 "%d deferred per token", on_gpu, spec.num_experts * len(masks), device.type,
                 args.kt_expert_placement_strategy, args.kt_max_deferred_experts_per_token)
        return cls(masks, list(spec.moe_layers), args.kt_max_deferred_experts_per_token, gpu_backend, device)


def _local_index(mask: torch.Tensor) -> torch.Tensor:
    """[E] int32: position of each expert among the selected ones, -1 for the others."""
    idx = torch.full(mask.shape, -1, dtype=torch.int32)
    idx[mask] = torch.arange(int(mask.sum()), dtype=torch.int32)
    return idx


class HybridExperts(MoEExperts):
    name = "hybrid"

    def __init__(self, weights: ExpertWeights, layer_idx: int, options: dict) -> None:
        from hybridmoe.moe.cpu_experts import CPUExperts

        plan: HybridPlan = options["hybrid"]
        self.plan, self.layer_idx = plan, layer_idx
        mask = plan.masks[layer_idx]
        dev = plan.device
        self.hidden = weights.hidden_size
        self.gpu_local = _local_index(mask).to(dev)  # [E]
        self.cpu_local = _local_index(~mask).to(dev)  # [E]
        self.is_first = layer_idx == plan.moe_layers[0]
        self.defer = 0 if layer_idx == plan.moe_layers[-1] else plan.num_deferred
        gpu_ids, cpu_ids = mask.nonzero().flatten(), (~mask).nonzero().flatten()
        self.gpu: MoEExperts | None = None
        self.cpu: CPUExperts | None = None
        if len(gpu_ids):  # only these experts' weights go to the GPU
            w = ExpertWeights(weights.gate_up[gpu_ids].to(dev), weights.down[gpu_ids].to(dev),
                              weights.activation)
            self.gpu = create_experts(plan.gpu_backend, w, layer_idx, options)
        if len(cpu_ids):  # only these stay in host memory, packed for the CPU kernels
            self.cpu = CPUExperts(ExpertWeights(weights.gate_up[cpu_ids], weights.down[cpu_ids], weights.activation),
                                  layer_idx, options)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        if self.is_first and plan.pending is not None:  # left over by an interrupted forward
            plan.pending.experts.sync(plan.pending.task)
            plan.pending = None
        ids = topk_ids.long()
        task = None
        deferred = None
        if self.cpu is not None:
            cid = self.cpu_local[ids]  # [T, K], -1 where the expert is on the GPU
            on_cpu = cid >= 0
            x_h = x.detach().to("cpu").contiguous()
            w_h = topk_weights.float().to("cpu").contiguous()
            now = cid
            if self.defer:
                # each token's `defer` lowest-weight CPU experts
                order = torch.where(on_cpu, topk_weights.float(), float("inf")).argsort(dim=1, stable=True)
                later = torch.zeros_like(on_cpu).scatter_(1, order[:, : self.defer], True) & on_cpu
                now = torch.where(later, -1, cid)
                ids_later = torch.where(later, cid, -1).to("cpu", torch.int32).contiguous()
            out_h = torch.empty(x.shape[0], self.hidden, dtype=torch.float32)
            task = self.cpu.submit(x_h, now.to("cpu", torch.int32).contiguous(), w_h, out_h)
            if self.defer:
                later_out = torch.empty_like(out_h)
                deferred = _Deferred(self.cpu, self.cpu.submit(x_h, ids_later, w_h, later_out), later_out)
        if self.gpu is not None:
            gid = self.gpu_local[ids]
            valid = gid >= 0
            # pairs of CPU experts: expert 0 with weight 0 (cheaper than a ragged batch on the GPU)
            out = self.gpu.forward(x, torch.where(valid, gid, 0), torch.where(valid, topk_weights, 0.0)).float()
        else:
            out = torch.zeros(x.shape[0], self.hidden, dtype=torch.float32, device=x.device)
        if task is not None:
            self.cpu.sync(task)
            out += out_h.to(x.device)
        if plan.pending is not None:
            plan.pending.experts.sync(plan.pending.task)
            out += plan.pending.out.to(x.device)
        plan.pending = deferred
        return out.to(x.dtype)


@register_experts_backend("hybrid")
def _make_hybrid(weights: ExpertWeights, layer_idx: int, options: dict) -> MoEExperts:
    return HybridExperts(weights, layer_idx, options)
