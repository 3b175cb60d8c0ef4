"""The load progress bar: layers done, GB read, GB/s and time left (tqdm).

The bar counts layers (tqdm's own rate and ETA are per layer); the postfix adds the bytes of the
model's tensors filled so far, of their expected total, and the fill rate in GB/s.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from tqdm import tqdm

GB = 1e9


def tensor_bytes(obj: object) -> int:
    """Bytes of the tensors of a tensor, a dataclass of tensors (ExpertWeights) or None."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    return sum(v.nbytes for v in vars(obj).values() if isinstance(v, torch.Tensor))


class LoadProgress:
    """A tqdm bar over the decoder layers with GB, GB/s and time left; disabled: nothing printed."""

    def __init__(self, num_layers: int, total_bytes: int | None, enabled: bool = True) -> None:
        self.bar = tqdm(total=num_layers, desc="Loading weights", unit="layer", disable=not enabled,
                        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} layers [{elapsed}<{remaining}{postfix}]")
        self.total = total_bytes
        self.done = 0
        self.t0 = time.perf_counter()

    def add_bytes(self, nbytes: int) -> None:
        self.done += nbytes

    def layer_done(self) -> None:
        rate = self.done / max(time.perf_counter() - self.t0, 1e-6) / GB
        size = f"{self.done / GB:.2f}/{self.total / GB:.2f} GB" if self.total else f"{self.done / GB:.2f} GB"
        self.bar.set_postfix_str(f"{size}, {rate:.2f} GB/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()

    def layers(self, n: int) -> Iterable[int]:
        """range(n), advancing the bar after each layer; closes the bar at the end."""
        try:
            for i in range(n):
                yield i
                self.layer_done()
        finally:
            self.close()
