"""Which routed experts live on the GPU (`--kt-expert-placement-strategy`), decided once at
startup (`HybridPlacement`, frozen), and the activation statistics that the `frequency` strategy
reads (`--record-expert-distribution` writes them: moe/recorder.py).

Legend: L MoE layers (by model layer index), E experts per layer, N GPU experts per layer.

Statistics (`--init-expert-location`): moe/expert_stats.py reads them.

GPU experts per layer: --kt-num-gpu-experts N per MoE layer, or --kt-gpu-experts-ratio R, which wins
when both are given and means what SGLang's kt wrapper makes of it: floor(R * E * L) GPU experts in all,
split evenly over the MoE layers, the first layers taking one more each for the remainder.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridmoe.config import ConfigError, HybridConfig, ModelConfig
from hybridmoe.moe.expert_stats import TRIVIAL, load_expert_counts

log = logging.getLogger(__name__)

# a ratio product within this of an integer counts as that integer (0.29 * 100 is 28.999999999999996)
_RATIO_EPS = 1e-9


@dataclass(frozen=True)
class HybridPlacement:
    """The GPU/CPU split of every MoE layer as decided at startup; never changed afterwards (the
    dynamic expert update changes the layers' own copies of their masks)."""

    masks: dict[int, torch.Tensor]  # layer -> [E] bool, True = on the GPU (read-only)
    moe_layers: tuple[int, ...]
    num_deferred: int  # --kt-max-deferred-experts-per-token (the last MoE layer defers nothing)
    gpu_backend: str  # the experts backend of the GPU side ("torch" | "triton")
    prefill_threshold: int | None = None  # layerwise GPU prefill from this many tokens on (None: never)
    dynamic_update: bool = False  # GPU/CPU expert swaps after each layerwise prefill

    def defer_of(self, layer: int, num_deferred: int | None = None) -> int:
        """Deferred experts per token of a MoE layer: none for the last one."""
        d = self.num_deferred if num_deferred is None else num_deferred
        return 0 if layer == self.moe_layers[-1] else d

    def gpu_experts(self, layer: int) -> int:
        return int(self.masks[layer].sum())


def build_placement(cfg: HybridConfig, model: ModelConfig, device: torch.device,
                    moe_backend: str | None = None) -> HybridPlacement | None:
    """The split asked for by the flags; None when there is none (all experts on the GPU, or all
    on the CPU engine without deferral or layerwise prefill off CUDA). `moe_backend` forces the GPU
    side's backend (torch | triton)."""
    if not cfg.split_requested:
        return None
    spec = model.spec
    asked, ratio = cfg.num_gpu_experts, cfg.gpu_experts_ratio
    n_gpu = gpu_expert_counts(spec.num_experts, len(spec.moe_layers), asked, ratio)
    if ratio is not None and asked is not None:
        log.warning("--kt-gpu-experts-ratio %s is set: --kt-num-gpu-experts %d is ignored (as in SGLang's kt "
                    "wrapper); %d GPU experts in all (%s x %d MoE layers x %d experts, rounded down)", ratio, asked,
                    sum(n_gpu), ratio, len(spec.moe_layers), spec.num_experts)
    elif asked is not None and asked > spec.num_experts:
        log.warning("--kt-num-gpu-experts %d is more than the %d routed experts per MoE layer of %s: using %d "
                    "(every routed expert on the GPU side, none on the CPU engine)", asked, spec.num_experts,
                    model.source, max(n_gpu, default=0))
    threshold = cfg.gpu_prefill_token_threshold
    # every expert on the CPU: the plain "cpu" backend, except on CUDA, where the hybrid layer
    # (empty GPU side) drives the CPU from the CUDA stream and CUDA graphs stay on
    if not any(n_gpu) and not cfg.max_deferred_experts_per_token and threshold is None and device.type != "cuda":
        return None
    try:
        masks = place_experts(cfg.placement_strategy, list(spec.moe_layers), spec.num_experts, n_gpu,
                              cfg.init_expert_location, cfg.seed, num_layers=model.num_layers)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    gpu_backend = moe_backend if moe_backend in ("torch", "triton") else (
        "triton" if device.type == "cuda" else "torch")
    on_gpu = sum(int(m.sum()) for m in masks.values())
    total = spec.num_experts * len(masks)
    log.info("hybrid experts: %d of %d routed experts on the GPU side (%s placement, %s backend on %s), %d on the "
             "CPU engine (%s); %d deferred per token", on_gpu, total, cfg.placement_strategy, gpu_backend,
             device.type, total - on_gpu, cfg.method, cfg.max_deferred_experts_per_token)
    if threshold is not None:
        log.info("layerwise prefill: forwards of %d tokens or more compute every expert on the %s%s", threshold,
                 device.type, "; dynamic expert update on (the CPU holds every expert)"
                 if cfg.dynamic_expert_update else "")
    return HybridPlacement(masks, tuple(spec.moe_layers), cfg.max_deferred_experts_per_token, gpu_backend,
                           prefill_threshold=threshold, dynamic_update=cfg.dynamic_expert_update)


def gpu_expert_counts(num_experts: int, num_moe_layers: int, num_gpu_experts: int | None,
                      ratio: float | None) -> list[int]:
    """GPU experts of each MoE layer, in layer order. --kt-gpu-experts-ratio R (which wins over
    --kt-num-gpu-experts, as in SGLang's kt wrapper): floor(R * E * L) in all, split evenly, the first layers
    taking one more each for the remainder; else --kt-num-gpu-experts N (within 0..E) in every layer."""
    if ratio is not None:
        total = math.floor(min(max(ratio, 0.0), 1.0) * num_experts * num_moe_layers + _RATIO_EPS)
        base, extra = divmod(total, num_moe_layers) if num_moe_layers else (0, 0)
        return [base + (i < extra) for i in range(num_moe_layers)]
    return [max(0, min(num_gpu_experts or 0, num_experts))] * num_moe_layers


def gpu_experts_per_layer(num_experts: int, num_gpu_experts: int | None, ratio: float | None,
                          num_moe_layers: int = 1) -> int:
    """The most GPU experts of any MoE layer (gpu_expert_counts); 0: none on the GPU side."""
    return max(gpu_expert_counts(num_experts, max(num_moe_layers, 1), num_gpu_experts, ratio))


def place_experts(
    strategy: str,
    moe_layers: list[int],
    num_experts: int,
    n_gpu: int | Sequence[int],
    stats_path: str | None = None,
    seed: int = 0,
    num_layers: int | None = None,
) -> dict[int, torch.Tensor]:
    """layer -> bool mask [E] of GPU-resident experts. `n_gpu`: GPU experts per MoE layer, one count for
    every layer or one per layer in order (gpu_expert_counts); the GPU holds their sum in all. `num_layers`:
    the model's layers (num_hidden_layers), against which an SGLang statistics file's rows are checked."""
    per_layer = [n_gpu] * len(moe_layers) if isinstance(n_gpu, int) else list(n_gpu)
    if len(per_layer) != len(moe_layers):
        raise ValueError(f"{len(per_layer)} GPU expert counts for {len(moe_layers)} MoE layers")
    if strategy == "uniform":
        return {layer: _mask(num_experts, range(n)) for layer, n in zip(moe_layers, per_layer)}
    if strategy == "front-loading":
        # The same total budget, filled from the first MoE layer on.
        left = sum(per_layer)
        masks = {}
        for layer in moe_layers:
            take = min(num_experts, left)
            masks[layer] = _mask(num_experts, range(take))
            left -= take
        return masks
    if strategy == "random":
        rng = random.Random(seed)
        return {layer: _mask(num_experts, rng.sample(range(num_experts), n)) for layer, n in zip(moe_layers, per_layer)}
    if strategy == "frequency":
        if not stats_path or stats_path == TRIVIAL:
            raise ValueError("--kt-expert-placement-strategy frequency needs --init-expert-location FILE, the "
                             "activation statistics (from --record-expert-distribution, or SGLang's "
                             f"/dump_expert_distribution_record){'; trivial holds none' if stats_path else ''}")
        counts = load_expert_counts(stats_path, moe_layers, num_experts, num_layers)
        # Most used first; ties by expert id so the choice is deterministic.
        return {layer: _mask(num_experts, sorted(range(num_experts), key=lambda e, c=counts[layer]: (-c[e], e))[:n])
                for layer, n in zip(moe_layers, per_layer)}
    raise ValueError(f"unknown placement strategy {strategy!r}")


def _mask(num_experts: int, ids) -> torch.Tensor:
    m = torch.zeros(num_experts, dtype=torch.bool)
    m[list(ids)] = True
    return m
