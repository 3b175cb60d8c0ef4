"""A cheap fingerprint of a checkpoint's routed-expert weights, recorded by `hybridmoe convert` and
checked when `--kt-weight-path` is loaded, so CPU weights converted from another checkpoint (a
fine-tune sharing config.json with its base) are refused instead of silently mixed in.

Per expert tensor (gate, up, down of every expert of every MoE layer) a few runs of consecutive
elements spread over the tensor are read (no whole tensor is read: a few KB per tensor) and hashed
together with the tensor's name and shape. The elements are hashed as their values rounded to
bfloat16, not as stored bytes: a bf16 copy of an fp32 or block-fp8 checkpoint (dequantized in
float32, as the usual cast scripts do) has the fingerprint of the original. A fine-tune changes
nearly every element, so it changes the sampled ones.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from hybridmoe.weights.loader import CheckpointError
from hybridmoe.weights.shards import DTYPES, TensorInfo, scan_checkpoint

SCHEME = "bf16-sample-v1"
SCHEMES = (SCHEME, "gguf-blocks-v1")  # the second: a GGUF source (gguf/convert_source.py)
RUNS, RUN = 4, 16  # per tensor: 4 runs of 16 consecutive elements
_FLOATS = ("F32", "F16", "BF16", "F64")
_FP8 = ("F8_E4M3", "F8_E5M2")
_cache: dict[tuple, str] = {}


def _starts(n: int) -> list[tuple[int, int]]:
    """(first element, count) of each sampled run of a tensor of n elements."""
    if n <= RUNS * RUN:
        return [(0, n)] if n else []
    return [(j * (n - RUN) // (RUNS - 1), RUN) for j in range(RUNS)]


class _Reader:
    """pread of byte ranges from the checkpoint's files, one descriptor per file."""

    def __init__(self) -> None:
        self.fds: dict[Path, int] = {}

    def read(self, info: TensorInfo, first: int, count: int) -> bytes:
        size = torch.empty(0, dtype=DTYPES[info.dtype]).element_size()
        fd = self.fds.get(info.file)
        try:
            if fd is None:
                fd = self.fds[info.file] = os.open(info.file, os.O_RDONLY)
            raw = os.pread(fd, count * size, info.start + first * size)
        except OSError as e:
            raise CheckpointError(f"{info.file}: cannot be read: {e}") from e
        if len(raw) != count * size:
            raise CheckpointError(f"{info.file}: short read (truncated file?)")
        return raw

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _values(reader: _Reader, tensors: dict[str, TensorInfo], name: str, info: TensorInfo,
            block: tuple[int, int] | None) -> bytes:
    """The sampled elements of tensor `name` as bfloat16 bytes (raw bytes for integer dtypes)."""
    out = []
    scale = None
    if info.dtype in _FP8:
        from hybridmoe.weights.fp8 import scale_name

        s_info = tensors.get(scale_name(name))
        if block is None or s_info is None or len(info.shape) != 2:
            raise CheckpointError(f"{info.file}: tensor {name!r} is fp8 without a block scale (weight_scale_inv "
                                  "and quantization_config.weight_block_size)")
        scale = torch.frombuffer(bytearray(reader.read(s_info, 0, s_info.numel)),
                                 dtype=DTYPES[s_info.dtype]).float().reshape(s_info.shape)
    for first, count in _starts(info.numel):
        raw = reader.read(info, first, count)
        if info.dtype not in _FLOATS and scale is None:
            out.append(raw)
            continue
        v = torch.frombuffer(bytearray(raw), dtype=DTYPES[info.dtype]).float()  # [count]
        if scale is not None:
            idx = torch.arange(first, first + count)
            k = info.shape[1]
            v = v * scale[idx // k // block[0], idx % k // block[1]]
        out.append(v.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return b"".join(out)


def expert_fingerprint(model_path: str | Path, spec, config=None) -> str:
    """`SCHEME:sha256` of the sampled routed-expert weights of the checkpoint in `model_path` (of the
    GGUF's blocks for a `--model FILE.gguf` view directory: gguf/convert_source.py)."""
    from hybridmoe.gguf.view import gguf_source

    if (gguf := gguf_source(model_path)) is not None:
        from hybridmoe.gguf.convert_source import gguf_fingerprint
        from hybridmoe.gguf.reader import GGUFModel

        return gguf_fingerprint(GGUFModel.open(gguf), spec)
    tensors = scan_checkpoint(model_path)
    files = sorted({t.file for t in tensors.values()})
    try:
        stamp = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    except OSError as e:
        raise CheckpointError(f"{model_path}: cannot be read: {e}") from e
    key = (str(Path(model_path).resolve()), spec.moe_layers, spec.num_experts, spec.expert_names, stamp)
    if key in _cache:  # checked at startup, then again when the engine loads the weights
        return _cache[key]
    block = None
    if any(t.dtype in _FP8 for t in tensors.values()):
        from hybridmoe.weights.fp8 import block_size_of

        try:
            block = block_size_of(config)
        except ValueError:
            block = None
    h = hashlib.sha256(SCHEME.encode())
    reader = _Reader()
    try:
        for layer in spec.moe_layers:
            for e in range(spec.num_experts):
                for name in spec.expert_tensor_names(layer, e):
                    info = tensors.get(name)
                    if info is None:
                        raise CheckpointError(f"tensor {name!r} is missing from the checkpoint {model_path}")
                    h.update(f"{name}{list(info.shape)}".encode())
                    h.update(_values(reader, tensors, name, info, block))
    finally:
        reader.close()
    _cache[key] = f"{SCHEME}:{h.hexdigest()}"
    return _cache[key]
