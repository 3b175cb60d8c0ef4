"""The routed-expert tensors of the checkpoint `hybridmoe convert` reads: pread into fresh buffers (no
mmap, so the resident memory is only the buffers filled), fp8 block-dequantized on the way.

Legend: N output rows, K input columns.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hybridmoe.weights.fp8 import FP8_DTYPES, block_dequant, block_size_of, scale_name
from hybridmoe.weights.loader import CheckpointError, SafetensorsIndex
from hybridmoe.weights.readahead import read_into
from hybridmoe.weights.shards import DTYPES, read_header

INPUT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


class ConvertError(CheckpointError):
    """A conversion that cannot proceed; the message names the file, tensor or option at fault."""


class SourceReader:
    """Expert tensors of the input checkpoint as float32, read with pread into fresh buffers."""

    def __init__(self, input_path: str, input_type: str, config) -> None:
        self.root = Path(input_path)
        self.input_type = input_type
        self.file_of = self._file_map(self.root)
        try:
            self.block = block_size_of(config) if input_type == "fp8" else None
        except ValueError as e:
            raise ConvertError(f"{self.root / 'config.json'}: {e}") from e
        self._files: dict[Path, tuple[int, dict, int]] = {}  # fd, header, data offset

    @staticmethod
    def _file_map(root: Path) -> dict[str, Path]:
        """Tensor name -> the file holding it (from the index of a sharded checkpoint, else the headers)."""
        if (root / "model.safetensors.index.json").is_file():
            return SafetensorsIndex(str(root)).file_of
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise ConvertError(f"{root}: no *.safetensors files (other weight formats are not supported)")
        return {name: f for f in files for name in read_header(f)[0] if name != "__metadata__"}

    def _open(self, path: Path) -> tuple[int, dict, int]:
        if path not in self._files:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise ConvertError(f"{path}: cannot be opened: {e}") from e
            header, start = read_header(path, fd)
            self._files[path] = (fd, header, start)
        return self._files[path]

    def raw(self, name: str) -> torch.Tensor:
        """Tensor `name` as stored (any dtype)."""
        path = self.file_of.get(name)
        if path is None:
            raise ConvertError(f"tensor {name!r} is missing from the checkpoint {self.root}")
        fd, header, start = self._open(path)
        info = header.get(name)
        if info is None or info.get("dtype") not in DTYPES:
            raise ConvertError(f"{path}: tensor {name!r} is missing or has an unsupported dtype")
        b, e = info["data_offsets"]
        buf = torch.empty(e - b, dtype=torch.uint8)
        try:
            read_into(fd, start + b, start + e, buf)
        except (OSError, EOFError) as err:
            raise ConvertError(f"{path}: tensor {name!r} cannot be read: {err}") from err
        return buf.view(DTYPES[info["dtype"]]).reshape(info["shape"])

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Fills out (float32 [N, K]) with tensor `name`, dequantizing fp8."""
        t = self.raw(name)
        where = f"{self.file_of[name].name}: tensor {name!r}"
        if tuple(t.shape) != tuple(out.shape):
            raise ConvertError(f"{where} has shape {tuple(t.shape)}, expected {tuple(out.shape)} from config.json")
        problem = self.dtype_problem(t.dtype)
        if problem is not None:
            raise ConvertError(f"{where} {problem}")
        if t.dtype in FP8_DTYPES:
            s = self.raw(scale_name(name))
            try:
                block_dequant(t, s, self.block, out=out)
            except ValueError as e:
                raise ConvertError(f"{where}: {e}") from e
            return
        out.copy_(t)

    def dtype_problem(self, dtype: torch.dtype) -> str | None:
        """Why an expert tensor of `dtype` cannot be read with this --input-type (None: it can)."""
        if dtype in FP8_DTYPES:
            return None if self.block is not None else f"is {dtype}: the checkpoint is fp8; use --input-type fp8"
        # fp8 checkpoints may keep some experts unquantized; a float32 checkpoint converts as any type
        allowed = (torch.bfloat16, torch.float16) if self.input_type == "fp8" else (INPUT_DTYPES[self.input_type],)
        if dtype not in (*allowed, torch.float32):
            return (f"is {dtype}, but --input-type is {self.input_type}; pass the input type of the checkpoint "
                    "(bf16, fp16 or fp8)")
        return None

    def close(self) -> None:
        for fd, _, _ in self._files.values():
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read once: leave the page cache to others
            os.close(fd)
        self._files.clear()
