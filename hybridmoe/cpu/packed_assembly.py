"""Assembling a packed layer in host memory from chunks of experts packed one after the other.

pack_layer (quant.py) quantizes `chunk` experts at a time (on the CPU, or on the GPU for random benchmark
weights). Each chunk's tensors are copied straight into the layer's host tensors, allocated once at the
first chunk: the host never holds the chunks and the concatenated layer at the same time (for a DeepSeek-V3
layer that would be 2 x 11.3 GB at INT8), so the host RSS of a load stays near the packed bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_FIELDS = ("data", "scale", "zero", "wsum")  # every tensor of a PackedMatrix has the experts on dim 0


class PackedAssembly:
    """One PackedMatrix [E, ...] filled chunk by chunk (`add` in expert order, then `result`).

    `alloc(shape, dtype)` makes the host tensors (quant.page_aligned_empty for page-locking in place).
    Duck-typed on PackedMatrix (quant.py imports this module)."""

    def __init__(self, num_experts: int, alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None):
        self.num_experts = num_experts
        self.alloc = alloc or (lambda shape, dtype: torch.empty(shape, dtype=dtype))
        self._kind: type | None = None
        self._out: dict[str, torch.Tensor | None] | None = None
        self._nk: tuple[int, int] = (0, 0)
        self._next = 0

    def add(self, part) -> None:
        """The next experts' packed matrix (on any device): copied into the host tensors."""
        if self._out is None:
            self._nk, self._kind = (part.n, part.k), type(part)
            self._out = {}
            for f in _FIELDS:
                t = getattr(part, f)
                if t is None:
                    self._out[f] = None
                    continue
                shape = (self.num_experts, *t.shape[1:])
                self._out[f] = self.alloc(shape, t.dtype)
        rows = part.data.shape[0]
        for f in _FIELDS:
            dst, src = self._out[f], getattr(part, f)
            if (dst is None) != (src is None):
                raise ValueError(f"packed chunks disagree on their {f} tensor")
            if dst is not None:
                dst[self._next:self._next + rows].copy_(src)
        self._next += rows

    def result(self):  # -> PackedMatrix
        if self._out is None or self._kind is None or self._next != self.num_experts:
            raise ValueError(f"packed layer assembled from {self._next} of {self.num_experts} experts")
        o = self._out
        return self._kind(o["data"], self._nk[0], self._nk[1], o["scale"], o["zero"], o["wsum"])
