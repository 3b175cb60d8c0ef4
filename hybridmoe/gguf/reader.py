"""GGUF files through the `gguf` package, memory-mapped: one file, a split set
(`NAME-00001-of-0000N.gguf`, any part or the directory holding it), or a directory with one model.

Legend: E experts, N rows, K values per row, RB bytes per row.

    f = GGUFModel.open("model-Q4_K_M.gguf")
    f.meta("qwen3moe.block_count")                   # metadata value
    gate = f.tensor("blk.3.ffn_gate_exps.weight")    # GGUFTensor: type, shape (E, N, K), torch view
    gate.rows()                                      # uint8 [E, N, RB], a view of the mapped file

Tensor shapes are given in torch order (GGUF stores them fastest dimension first). Nothing is
copied: `rows()` and `values()` are views of the read-only mapping (write to them and the process
faults).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hybridmoe.config import ConfigError
from hybridmoe.cpu import gguf_quant
from hybridmoe.gguf import paths
from hybridmoe.gguf.open_part import open_parts

FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}


class GGUFError(ConfigError):
    """A GGUF file that cannot be served (a startup configuration error): missing, unreadable, a missing tensor, an unsupported type."""


@dataclass
class GGUFTensor:
    name: str
    type: int  # GGML type id
    shape: tuple[int, ...]  # torch order: (..., K)
    data: np.ndarray  # the reader's memory-mapped view
    file: str

    @property
    def type_name(self) -> str:
        if self.type in FLOAT_TYPES:
            return FLOAT_TYPES[self.type]
        if self.type in gguf_quant.TYPES:
            return gguf_quant.TYPES[self.type][0]
        try:
            from gguf import GGMLQuantizationType

            return GGMLQuantizationType(self.type).name
        except Exception:
            return f"type {self.type}"

    def rows(self) -> torch.Tensor:
        """Quantized tensor -> uint8 [..., N, RB] view of the file (no copy)."""
        if self.type not in gguf_quant.TYPES:
            raise GGUFError(f"{self.file}: tensor {self.name} is {self.type_name}, which the CPU kernels do not support "
                            f"(supported: {', '.join(sorted(gguf_quant.TYPE_IDS))})")
        rb = gguf_quant.row_bytes(self.type, self.shape[-1])
        return _view(self.data.view(np.uint8).reshape(*self.shape[:-1], rb))

    def values(self) -> torch.Tensor:
        """The tensor as float32 [shape] (dequantized; a view for F32)."""
        if self.type == 0:
            return _view(self.data.view(np.float32).reshape(self.shape))
        if self.type == 1:
            return _view(self.data.view(np.float16).reshape(self.shape)).float()
        if self.type == 30:
            return _view(self.data.view(np.int16).reshape(self.shape)).view(torch.bfloat16).float()
        if self.type in gguf_quant.TYPES:
            return gguf_quant.dequantize(self.rows(), self.type)
        try:
            from gguf import GGMLQuantizationType, quants

            out = quants.dequantize(np.asarray(self.data), GGMLQuantizationType(self.type))
            return torch.from_numpy(np.ascontiguousarray(out)).reshape(self.shape)
        except Exception as e:
            raise GGUFError(f"{self.file}: tensor {self.name} has type {self.type_name}, which cannot be "
                            f"dequantized ({e})") from None


def _view(a: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # the mapping is read-only; torch warns about non-writable arrays
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def split_parts(path: str | Path) -> list[Path]:
    """The files of the model at `path` (gguf/paths.py), a bad path as a GGUFError."""
    try:
        return paths.split_parts(path)
    except paths.GGUFPathError as e:
        raise GGUFError(str(e)) from None


class GGUFModel:
    """The tensors and metadata of one GGUF model (all its split parts), memory-mapped."""

    def __init__(self, parts: list[Path]):
        self.parts = parts
        self.path = str(parts[0])
        self.tensors: dict[str, GGUFTensor] = {}
        self.metadata: dict[str, object] = {}
        try:
            readers = open_parts(parts)
        except paths.GGUFPathError as e:
            raise GGUFError(str(e)) from None
        for p, r in zip(parts, readers, strict=True):
            for k, f in r.fields.items():
                if k not in self.metadata:
                    try:
                        self.metadata[k] = f.contents()
                    except Exception:
                        self.metadata[k] = None
            for t in r.tensors:
                if t.name in self.tensors:
                    raise GGUFError(f"{p}: tensor {t.name} is also in {self.tensors[t.name].file}: the split files "
                                    "do not belong together")
                shape = tuple(int(d) for d in reversed(list(t.shape)))
                self.tensors[t.name] = GGUFTensor(t.name, int(t.tensor_type), shape, t.data, str(p))

    @classmethod
    def open(cls, path: str | Path) -> GGUFModel:
        return cls(split_parts(path))

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def meta(self, key: str, default=None):
        return self.metadata.get(key, default)

    def tensor(self, name: str) -> GGUFTensor:
        t = self.tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.path}: no tensor {name}")
        return t

    def has(self, name: str) -> bool:
        return name in self.tensors
