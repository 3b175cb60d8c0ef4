"""The safetensors files of a checkpoint, checked from their headers alone (no tensor data read):
where each tensor lives, and whether every file is complete.

A file cut short (an interrupted download or copy) still has a valid header; it is found here by
comparing the file's size with the end offset the header gives for each tensor, so the error names
the file and the first tensor that does not fit, before anything is loaded.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridmoe.weights.errors import CheckpointError

INDEX = "model.safetensors.index.json"
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint: its file, dtype name, shape and absolute byte range in the file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: Path, fd: int | None = None) -> tuple[dict, int]:
    """(header, offset of the data section) of a safetensors file."""
    try:
        own = fd is None
        # O_NONBLOCK: opening a FIFO named *.safetensors for reading waited for a writer forever (no effect on
        # the reads of a regular file)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK) if own else fd
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError("not a regular file")
            head = os.pread(fd, 8, 0)
            if len(head) < 8:
                raise ValueError("shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                raise ValueError(f"header length {n} is implausible")
            raw = os.pread(fd, n, 8)
            if len(raw) < n:
                raise ValueError("truncated header")
            header = json.loads(raw)
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
            return header, 8 + n
        finally:
            if own:
                os.close(fd)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file: {e}") from e
    except RecursionError as e:  # json's parser recurses per nesting level: [[[...]]] 50000 deep
        raise CheckpointError(f"{path}: not a readable safetensors file: the header is nested too deeply") from e


def _tensor(path: Path, name: str, info: object, data_start: int, size: int) -> TensorInfo:
    """The entry `name` of `path`'s header, checked against the dtype, the shape and the file size."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict) or info.get("dtype") not in DTYPES:
        raise CheckpointError(f"{where}: a damaged header entry or an unsupported dtype ({info!r:.120})")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise CheckpointError(f"{where}: the header's shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{where}: the header's data_offsets {offsets!r} are damaged")
    itemsize = torch.empty(0, dtype=DTYPES[info["dtype"]]).element_size()
    need = math.prod(shape) * itemsize
    if offsets[1] - offsets[0] != need:
        raise CheckpointError(f"{where}: {info['dtype']} {shape} needs {need} bytes, the header gives it "
                              f"{offsets[1] - offsets[0]}: the file is damaged")
    end = data_start + offsets[1]
    if end > size:
        raise CheckpointError(f"{where} ends at byte {end}, but the file has {size} bytes: the file is truncated "
                              "(an interrupted download or copy?); fetch it again")
    return TensorInfo(path, info["dtype"], tuple(shape), data_start + offsets[0], need)


def scan_file(path: Path) -> dict[str, TensorInfo]:
    """Every tensor of one safetensors file, checked (see `_tensor`)."""
    header, data_start = read_header(path)
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        # safetensors itself refuses the file at load: found here, before the startup says the checks passed
        raise CheckpointError(f"{path}: not a readable safetensors file: __metadata__ is {meta!r:.80}, expected an "
                              "object of strings")
    try:
        size = path.stat().st_size
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read: {e}") from e
    return {name: _tensor(path, name, info, data_start, size) for name, info in header.items()
            if name != "__metadata__"}


def read_index(index: Path) -> dict[str, str]:
    """The weight_map (tensor name -> shard file name) of a model.safetensors.index.json, checked: the startup
    scan and the weight loader both read it through here, so a malformed index is the same one line in both
    (the loader's own reading met a list as weight_map with an AttributeError)."""
    try:
        if index.stat().st_size > _MAX_HEADER:  # read whole: a huge (or sparse) file took that much memory
            raise ValueError(f"{index.stat().st_size} bytes, implausible for an index")
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError("weight_map is not an object of file names")
        # the shards are the directory's own files: "../other-model/x.safetensors" or "/data/x.safetensors" would
        # load tensors from elsewhere on the host (an index from the Hub is not trusted with that)
        outside = next((v for v in weight_map.values() if Path(v).is_absolute() or ".." in Path(v).parts), None)
        if outside is not None:
            raise ValueError(f"weight_map names {outside!r}, a file outside the model directory")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a safetensors index (expected a weight_map of tensor -> file): "
                              f"{e}") from e
    except RecursionError as e:  # json's parser recurses per nesting level
        raise CheckpointError(f"{index}: not a safetensors index: nested too deeply") from e
    return weight_map


def scan_checkpoint(model_path: str | Path) -> dict[str, TensorInfo]:
    """Tensor name -> TensorInfo for a checkpoint directory (sharded with an index, or *.safetensors)."""
    root = Path(model_path)
    index = root / INDEX
    if not index.is_file():
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{root}: no *.safetensors files (other weight formats are not supported)")
        out: dict[str, TensorInfo] = {}
        for f in files:
            out.update(scan_file(f))
        return out
    weight_map = read_index(index)
    scanned: dict[str, dict[str, TensorInfo]] = {}
    out = {}
    for name, fname in weight_map.items():
        f = root / fname
        if fname not in scanned:
            if not f.is_file():
                raise CheckpointError(f"{index} lists {fname} (tensor {name!r}), which is missing")
            scanned[fname] = scan_file(f)
        if name not in scanned[fname]:
            raise CheckpointError(f"{index} puts tensor {name!r} in {fname}, whose header does not have it")
        out[name] = scanned[fname][name]
    return out
