"""`--record-expert-distribution`: per-layer expert activation counts, written as the statistics
file that the `frequency` placement reads (format: moe/placement.py). The recorder wraps a layer's
experts backend, so model code knows nothing of it.

Legend: T tokens, K top-k, E experts per layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hybridmoe.moe.experts import MoEExperts
from hybridmoe.moe.placement import STATS_FORMAT


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


class RecordingExperts(MoEExperts):
    """An experts backend that counts each token's selected experts before computing them."""

    def __init__(self, inner: MoEExperts, recorder: ExpertDistributionRecorder, layer_idx: int) -> None:
        self.inner, self.recorder, self.layer_idx = inner, recorder, layer_idx
        self.name = inner.name

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self.recorder.record(self.layer_idx, topk_ids)
        return self.inner.forward(x, topk_ids, topk_weights)

    def forward_with(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, extra) -> torch.Tensor:
        self.recorder.record(self.layer_idx, topk_ids)
        return self.inner.forward_with(x, topk_ids, topk_weights, extra)

    def __getattr__(self, name: str):  # the wrapped backend's own attributes (tests, benchmarks)
        return getattr(self.__dict__["inner"], name)
