"""A GGUF as the input of `hybridmoe convert --input-type gguf`: the routed experts read block by
block (one expert's rows at a time, dequantized with the reference dequantizers of cpu/gguf_quant.py),
and the fingerprint that binds the converted directory to this GGUF.

Legend: N rows, K values per row.
"""

from __future__ import annotations

import hashlib

import torch

from hybridmoe.gguf.experts import expert_name, open_for_model
from hybridmoe.gguf.reader import GGUFModel
from hybridmoe.gguf.weights import GGUFWeights

SCHEME = "gguf-blocks-v1"
SAMPLE_BYTES = 1 << 16  # hashed from the start, the middle and the end of every expert tensor


class GGUFSourceReader:
    """SourceReader's interface (read_into, dtype_problem, close) over the experts of a GGUF."""

    def __init__(self, gguf_path: str, config, spec) -> None:
        self.model = open_for_model(gguf_path, config, spec, source="--input-path")  # names, shapes, types
        self.weights = GGUFWeights(self.model)

    def dtype_problem(self, dtype) -> str | None:
        return None  # the types were checked when opening (layer_experts)

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Fills out (float32 [N, K]) with expert tensor `name` (a Hugging Face name), dequantized."""
        self.weights.fill(name, out)

    def close(self) -> None:
        pass


def gguf_fingerprint(model: GGUFModel, spec) -> str:
    """`SCHEME:sha256` over every MoE layer's expert tensors: name, type, shape and sampled blocks."""
    h = hashlib.sha256(SCHEME.encode())
    for layer in spec.moe_layers:
        for proj in ("gate", "up", "down"):
            t = model.tensor(expert_name(layer, proj))
            raw = t.data.reshape(-1).view("uint8")
            n = len(raw)
            h.update(f"{t.name}|{t.type}|{list(t.shape)}|{n}".encode())
            for start in (0, max(0, n // 2 - SAMPLE_BYTES // 2), max(0, n - SAMPLE_BYTES)):
                h.update(raw[start: start + SAMPLE_BYTES].tobytes())
    return f"{SCHEME}:{h.hexdigest()}"
