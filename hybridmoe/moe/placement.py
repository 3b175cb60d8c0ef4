"""Which routed experts live on the GPU (`--kt-expert-placement-strategy`), decided once at
startup (`HybridPlacement`, frozen), and the activation statistics that the `frequency` strategy
reads (`--record-expert-distribution` writes them: moe/recorder.py).

Legend: L MoE layers (by model layer index), E experts per layer, N GPU experts per layer.

Statistics file (JSON): {"format": "hybridmoe-expert-distribution", "version": 1,
"num_experts": E, "counts": {"<layer index>": [count of expert 0, ...], ...}}.
"""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridmoe.config import ConfigError, HybridConfig, ModelConfig

log = logging.getLogger(__name__)

STATS_FORMAT = "hybridmoe-expert-distribution"
STATS_VERSION = 1
# a statistics file holds a count per expert per MoE layer: a few MB for the largest models
MAX_STATS_BYTES = 64 << 20


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
    asked = cfg.num_gpu_experts
    n_gpu = gpu_experts_per_layer(spec.num_experts, cfg.num_gpu_experts, cfg.gpu_experts_ratio)
    if asked is not None and asked > spec.num_experts:
        log.warning("--kt-num-gpu-experts %d is more than the %d routed experts per MoE layer of %s: using %d "
                    "(every routed expert on the GPU side, none on the CPU engine)", asked, spec.num_experts,
                    model.source, n_gpu)
    threshold = cfg.gpu_prefill_token_threshold
    # every expert on the CPU: the plain "cpu" backend, except on CUDA, where the hybrid layer
    # (empty GPU side) drives the CPU from the CUDA stream and CUDA graphs stay on
    if n_gpu == 0 and not cfg.max_deferred_experts_per_token and threshold is None and device.type != "cuda":
        return None
    try:
        masks = place_experts(cfg.placement_strategy, list(spec.moe_layers), spec.num_experts, n_gpu,
                              cfg.init_expert_location, cfg.seed)
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


def gpu_experts_per_layer(num_experts: int, num_gpu_experts: int | None, ratio: float | None) -> int:
    n = num_gpu_experts if num_gpu_experts is not None else round((ratio or 0.0) * num_experts)
    return max(0, min(n, num_experts))


def place_experts(
    strategy: str,
    moe_layers: list[int],
    num_experts: int,
    n_gpu: int,
    stats_path: str | None = None,
    seed: int = 0,
) -> dict[int, torch.Tensor]:
    """layer -> bool mask [E] of GPU-resident experts; the GPU holds n_gpu * len(layers) in all."""
    if strategy == "uniform":
        return {layer: _mask(num_experts, range(n_gpu)) for layer in moe_layers}
    if strategy == "front-loading":
        # The same total budget, filled from the first MoE layer on.
        left = n_gpu * len(moe_layers)
        masks = {}
        for layer in moe_layers:
            take = min(num_experts, left)
            masks[layer] = _mask(num_experts, range(take))
            left -= take
        return masks
    if strategy == "random":
        rng = random.Random(seed)
        return {layer: _mask(num_experts, rng.sample(range(num_experts), n_gpu)) for layer in moe_layers}
    if strategy == "frequency":
        if not stats_path:
            raise ValueError("--kt-expert-placement-strategy frequency needs --init-expert-location FILE "
                             "(written by --record-expert-distribution)")
        counts = load_expert_counts(stats_path, moe_layers, num_experts)
        # Most used first; ties by expert id so the choice is deterministic.
        return {layer: _mask(num_experts, sorted(range(num_experts), key=lambda e, c=counts[layer]: (-c[e], e))[:n_gpu])
                for layer in moe_layers}
    raise ValueError(f"unknown placement strategy {strategy!r}")


def _mask(num_experts: int, ids) -> torch.Tensor:
    m = torch.zeros(num_experts, dtype=torch.bool)
    m[list(ids)] = True
    return m


def load_expert_counts(path: str, moe_layers: list[int], num_experts: int) -> dict[int, list[float]]:
    """Per-layer expert activation counts from a statistics file: one non-negative finite count per expert of
    every MoE layer of the model, and no other layer; errors (ValueError) name the file and what was expected."""
    p = Path(path)
    where = f"--init-expert-location {p}"
    try:
        size = p.stat().st_size
        data = json.loads(p.read_text()) if size <= MAX_STATS_BYTES else None
    except OSError as e:
        raise ValueError(f"{where}: cannot be read: {e}") from None
    except ValueError as e:  # UnicodeDecodeError included
        raise ValueError(f"{where}: cannot be read as JSON: {e}") from None
    except RecursionError:  # json's parser recurses per nesting level: [[[...]]] 100000 deep
        raise ValueError(f"{where}: cannot be read as JSON: nested too deeply") from None
    if size > MAX_STATS_BYTES:  # read whole: a huge (or sparse) file took its size in memory
        raise ValueError(f"{where}: {size} bytes, more than a statistics file can be ({MAX_STATS_BYTES >> 20} MiB)")
    if not isinstance(data, dict) or data.get("format") != STATS_FORMAT:
        raise ValueError(f"{where}: not an expert distribution file (expected a JSON object with format "
                         f"{STATS_FORMAT!r}, written by --record-expert-distribution)")
    if data.get("version", STATS_VERSION) != STATS_VERSION:
        raise ValueError(f"{where}: version {data.get('version')!r}, this hybridmoe reads version {STATS_VERSION}")
    if data.get("num_experts") != num_experts or isinstance(data.get("num_experts"), bool):
        raise ValueError(f"{where}: recorded for {data.get('num_experts')!r} experts per layer, the model has "
                         f"{num_experts}")
    raw = data.get("counts")
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: field 'counts' is {type(raw).__name__}, expected an object of MoE layer index "
                         f"-> {num_experts} counts")
    counts: dict[int, list[float]] = {}
    for key, row in raw.items():
        try:
            layer = int(key)
        except ValueError:
            layer = None
        if layer not in moe_layers:  # recorded for another model (or not by the recorder)
            raise ValueError(f"{where}: counts for layer {key!r}, which is not a MoE layer of the model (expected "
                             f"the MoE layers {moe_layers})")
        ok = isinstance(row, list) and len(row) == num_experts and all(
            isinstance(c, (int, float)) and not isinstance(c, bool) and c >= 0
            and (isinstance(c, int) or math.isfinite(c)) for c in row)
        if not ok:
            raise ValueError(f"{where}: counts of layer {key}: expected a list of {num_experts} non-negative finite "
                             f"numbers, got {str(row)[:80]}")
        counts[layer] = row
    missing = [layer for layer in moe_layers if layer not in counts]
    if missing:
        raise ValueError(f"{where}: no counts for MoE layer(s) {missing}")
    return counts
