"""Which routed experts live on the GPU (`--kt-expert-placement-strategy`), and the activation
statistics that the `frequency` strategy reads (`--record-expert-distribution` writes them).

Legend: L MoE layers (by model layer index), E experts per layer, N GPU experts per layer.

Statistics file (JSON): {"format": "hybridmoe-expert-distribution", "version": 1,
"num_experts": E, "counts": {"<layer index>": [count of expert 0, ...], ...}}.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

STATS_FORMAT = "hybridmoe-expert-distribution"


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


def load_expert_counts(path: str, moe_layers: list[int], num_experts: int) -> dict[int, list[int]]:
    """Per-layer expert activation counts from a statistics file; errors name the file and field."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--init-expert-location {p}: cannot be read as JSON: {e}") from e
    if data.get("format") != STATS_FORMAT:
        raise ValueError(f"--init-expert-location {p}: not an expert distribution file (format field)")
    if data.get("num_experts") != num_experts:
        raise ValueError(f"--init-expert-location {p}: recorded for {data.get('num_experts')} experts per layer, "
                         f"the model has {num_experts}")
    counts = {int(k): v for k, v in data.get("counts", {}).items()}
    missing = [layer for layer in moe_layers if layer not in counts]
    if missing:
        raise ValueError(f"--init-expert-location {p}: no counts for MoE layer(s) {missing}")
    return counts


class ExpertDistributionRecorder:
    """Accumulates per-layer expert activation counts on the device (no host sync per step) and
    writes the statistics file."""

    def __init__(self, path: str, num_experts: int) -> None:
        self.path = path
        self.num_experts = num_experts
        self.counts: dict[int, torch.Tensor] = {}

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:  # topk_ids [T, K]
        c = self.counts.get(layer)
        if c is None:
            c = self.counts[layer] = torch.zeros(self.num_experts, dtype=torch.int64, device=topk_ids.device)
        c += torch.bincount(topk_ids.reshape(-1).long(), minlength=self.num_experts)

    def dump(self) -> None:
        data = {"format": STATS_FORMAT, "version": 1, "num_experts": self.num_experts,
                "counts": {str(k): v.tolist() for k, v in sorted(self.counts.items())}}
        tmp = Path(self.path).with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.path)
