"""Write a .safetensors file tensor by tensor: the header is built from the planned (key, dtype,
shape) list first, then the tensors' bytes are appended in that order, so at most one tensor is in
memory (safetensors' own save_file needs them all at once).

Format: 8-byte little-endian header length, a JSON header {key: {dtype, shape, data_offsets}}
(padded with spaces so the data starts 8-byte aligned), then the data, entries back to back.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

# bytes per element of safetensors' dtype names
DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


@dataclass(frozen=True)
class Entry:
    """One tensor of the file to write: its key, safetensors dtype name and shape."""

    key: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


def header(entries: Sequence[Entry], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and JSON header of a file holding `entries` in this order."""
    h: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    off = 0
    for e in entries:
        h[e.key] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [off, off + e.nbytes]}
        off += e.nbytes
    text = json.dumps(h, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class StreamWriter:
    """`with StreamWriter(path, entries) as w: w.write(t) ...`: the tensors' bytes in entry order (one
    tensor may cover several consecutive entries: a stacked [E, ...] tensor whose E slices are E
    entries). Written to `path` + '.tmp' and renamed on a complete, checked close; removed on error."""

    def __init__(self, path: str | Path, entries: Sequence[Entry], metadata: dict[str, str] | None = None) -> None:
        self.path, self.tmp = Path(path), Path(f"{path}.tmp")
        self.total = sum(e.nbytes for e in entries)
        self.written = 0
        self._head = header(entries, metadata)
        self._f = None

    def __enter__(self) -> StreamWriter:
        self._f = open(self.tmp, "wb")  # closed in __exit__
        self._f.write(self._head)
        return self

    def write(self, t: torch.Tensor) -> None:
        """Append one tensor's bytes (its dtype must be the entries'; the caller checked that)."""
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        if self.written + data.nbytes > self.total:
            raise ValueError(f"{self.path}: more tensor bytes than the header plans ({self.total})")
        self._f.write(data)
        self.written += data.nbytes

    def __exit__(self, exc_type, exc, tb) -> None:
        self._f.close()
        if exc_type is None and self.written != self.total:
            self.tmp.unlink(missing_ok=True)
            raise ValueError(f"{self.path}: wrote {self.written} tensor bytes, the header plans {self.total}")
        if exc_type is not None:
            self.tmp.unlink(missing_ok=True)
            return
        os.replace(self.tmp, self.path)
