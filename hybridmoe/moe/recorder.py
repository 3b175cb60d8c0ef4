"""`--record-expert-distribution`: per-layer expert activation counts, written as the statistics
file that the `frequency` placement reads (format: moe/placement.py). The recorder wraps a layer's
experts backend, so model code knows nothing of it.

Legend: T tokens, K top-k, E experts per layer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from hybridmoe.moe.expert_stats import STATS_FORMAT
from hybridmoe.moe.experts import MoEExperts


class ExpertDistributionRecorder:
    """Accumulates per-layer expert activation counts on the device (index_add_: no host sync, and
    capturable in a CUDA graph) and writes the statistics file.

    Counting never stops; a record (the /start_ and /stop_expert_distribution_record endpoints) is
    the difference of two snapshots, so decode CUDA graphs need no recapture. `path`: where `dump`
    writes by default (--record-expert-distribution; None: only explicit paths)."""

    def __init__(self, path: str | None, num_experts: int, device: torch.device | None = None,
                 layers: tuple[int, ...] = ()) -> None:
        self.path = path
        self.num_experts = num_experts
        self.counts: dict[int, torch.Tensor] = {}  # layer -> [E] int64, cumulative
        for layer in layers:  # allocated up front: a first use inside a graph capture allocates nothing
            self.counts[layer] = torch.zeros(num_experts, dtype=torch.int64, device=device)
        self._start: dict[int, torch.Tensor] | None = None  # snapshot at start (None: from the beginning)
        self._stop: dict[int, torch.Tensor] | None = None  # snapshot at stop (None: still recording)
        self.recording = path is not None
        # while a CUDA graph is captured: a device [1] int64 holding how many leading rows of each forward are
        # real (the graph's padding rows, and the warm-up and capture forwards with it at 0, count nothing)
        self.valid_rows: torch.Tensor | None = None

    @contextmanager
    def rows_counted(self, valid_rows: torch.Tensor) -> Iterator[None]:
        """Forwards inside count only their first valid_rows[0] rows (a graph's static buffer, set per replay)."""
        self.valid_rows = valid_rows
        try:
            yield
        finally:
            self.valid_rows = None

    def count_target(self, layer: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(counts [E] int64 of `layer`, valid rows [1] or None) for a kernel that counts itself (the fused
        router, moe/router_triton.py): what `record` would add to."""
        c = self.counts.get(layer)
        if c is None:
            c = self.counts[layer] = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
        return c, self.valid_rows.to(device) if self.valid_rows is not None else None

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:  # topk_ids [T, K]
        c, _ = self.count_target(layer, topk_ids.device)
        if topk_ids.is_cuda:  # one Triton launch, not ~6 torch ones (recorder_kernel.py)
            from hybridmoe.moe.recorder_kernel import count_experts

            vr = self.valid_rows.to(topk_ids.device) if self.valid_rows is not None else None
            count_experts(c, topk_ids, vr)
            return
        flat = topk_ids.reshape(-1).long()
        if self.valid_rows is None:
            ones = torch.ones_like(flat)
        else:  # [T, K] -> [T * K]: 1 for the pairs of real rows
            t, k = topk_ids.shape
            real = torch.arange(t, device=flat.device) < self.valid_rows.to(flat.device)  # [T]
            ones = real.long()[:, None].expand(t, k).reshape(-1)
        c.index_add_(0, flat, ones)

    def _snapshot(self) -> dict[int, torch.Tensor]:
        return {k: v.clone() for k, v in self.counts.items()}

    def start(self) -> None:
        """Begin a new record (the counts so far are left out of it)."""
        self._start, self._stop, self.recording = self._snapshot(), None, True

    def stop(self) -> None:
        """End the record; `dump` writes the counts between start and now."""
        if self.recording:
            self._stop, self.recording = self._snapshot(), False

    def recorded(self) -> dict[int, list[int]]:
        """Per-layer counts of the current (or last) record."""
        end = self._stop if self._stop is not None else self.counts
        out = {}
        for k, v in sorted(end.items()):
            base = self._start.get(k) if self._start is not None else None
            out[k] = (v - base if base is not None else v).tolist()
        return out

    def dump(self, path: str | None = None) -> str:
        """Write the statistics file (the format --init-expert-location reads); its path."""
        path = path or self.path
        if path is None:
            raise ValueError("no path to write the expert distribution to")
        data = {"format": STATS_FORMAT, "version": 1, "num_experts": self.num_experts,
                "counts": {str(k): v for k, v in self.recorded().items()}}
        tmp = Path(path).with_name(Path(path).name + ".tmp")  # not with_suffix: stats.json would take stats.tmp
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
        return str(path)


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
