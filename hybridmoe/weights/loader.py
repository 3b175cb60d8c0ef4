"""Load a Hugging Face model directory: config, safetensors (single file or sharded), into a
MoECausalLM; routed experts are stacked per layer and handed to the chosen MoE backend.

Errors name the file and tensor at fault; a progress bar counts layers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from hybridmoe.models.base import ArchSpec, MoECausalLM
from hybridmoe.models.registry import arch_spec
from hybridmoe.moe.experts import ExpertWeights, MoEExperts

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A model directory that cannot be loaded; the message names the file or tensor."""


def load_hf_config(model_path: str, trust_remote_code: bool = False):
    """The transformers config of a local model directory."""
    from hybridmoe.models.hf_config import load_config

    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face model directory)")
    try:
        return load_config(path, trust_remote_code)  # models/hf_config.py: transformers' class, aliases
    except Exception as e:  # transformers raises many types; name the file
        raise CheckpointError(f"{path / 'config.json'}: cannot be read: {e}") from e


def _open(path: Path):
    """safe_open, with an error naming the file (safetensors' own does not)."""
    try:
        return safe_open(str(path), "pt")
    except Exception as e:  # SafetensorError, OSError: a truncated or damaged file
        raise CheckpointError(f"{path}: not a readable safetensors file: {' '.join(str(e).split())}") from e


class SafetensorsIndex:
    """Which file holds each tensor of a checkpoint; opens files lazily, once each."""

    def __init__(self, model_path: str) -> None:
        root = Path(model_path)
        index = root / "model.safetensors.index.json"
        self.file_of: dict[str, Path] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index (no weight_map): {e}") from e
            for name, fname in weight_map.items():
                self.file_of[name] = root / fname
            for f in set(self.file_of.values()):
                if not f.is_file():
                    raise CheckpointError(f"{index} lists {f.name}, which is missing")
        else:
            files = sorted(root.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{root}: no *.safetensors files (other weight formats are not supported)")
            for f in files:
                with _open(f) as h:
                    for name in h.keys():
                        self.file_of[name] = f
        self._handles: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        f = self.file_of.get(name)
        if f is None:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
        h = self._handles.get(f)
        if h is None:
            h = self._handles[f] = _open(f)
        try:
            t = h.get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{f.name}: tensor {name!r} cannot be read: {e}") from e
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{f.name}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise CheckpointError(f"{f.name}: tensor {name!r} has dtype {t.dtype}; bf16, fp16 or fp32 expected")
        return t


    def fill(self, name: str, dst: torch.Tensor) -> None:
        """Copy tensor `name` into dst, checking its shape."""
        dst.copy_(self.get(name, tuple(dst.shape)))


class DummyWeights:
    """Random weights generated in place on the target device (`--load-format dummy`), for
    benchmarks of full-size shapes without a checkpoint on disk."""

    def __init__(self, std: float = 0.02, seed: int = 0) -> None:
        self.std = std
        self.seed = seed

    def __contains__(self, name: str) -> bool:
        return True

    def fill(self, name: str, dst: torch.Tensor) -> None:
        if "norm" in name:
            dst.fill_(1.0)
        elif dst.device.type == "cpu" and torch.cuda.is_available():
            # host-side tensors (CPU experts) are drawn on the GPU: ~100x faster than on the CPU
            dst.copy_(torch.empty(dst.shape, dtype=dst.dtype, device="cuda").normal_(0.0, self.std))
        else:
            dst.normal_(0.0, self.std)


ExpertsBuilder = Callable[[ExpertWeights, int], MoEExperts]


def load_model(
    model_path: str,
    config,
    dtype: torch.dtype,
    device: torch.device,
    make_experts: ExpertsBuilder,
    expert_device: Callable[[int], torch.device] | None = None,
    max_position: int | None = None,
    progress: bool = True,
    load_format: str = "auto",
    read_experts: bool = True,
    spec: ArchSpec | None = None,
) -> MoECausalLM:
    """Build the model on `device` in `dtype` and fill it from the checkpoint.

    make_experts(weights, layer_idx) creates each MoE layer's experts backend; expert_device(layer)
    says where that layer's stacked expert tensors are assembled (default: `device`). With
    read_experts=False the routed experts are not read (the backend has them from elsewhere, e.g.
    `--kt-weight-path`) and make_experts gets None. `spec`: the architecture (ModelConfig.spec),
    resolved from `config` when not given.
    """
    spec = spec or arch_spec(config, f"{model_path}/config.json")
    index = DummyWeights() if load_format == "dummy" else SafetensorsIndex(model_path)
    max_position = max_position or getattr(config, "max_position_embeddings", 4096)
    with torch.device("meta"):
        model = MoECausalLM(config, spec, max_position)
    model = model.to_empty(device=device).to(dtype)
    model.model.rotary.build(device)

    params = dict(model.named_parameters())
    by_layer: dict[int, list[str]] = {}
    top: list[str] = []
    for name in params:
        parts = name.split(".")
        (by_layer.setdefault(int(parts[2]), []) if parts[:2] == ["model", "layers"] else top).append(name)

    with torch.no_grad():
        for name in top:
            src = name
            if name == "lm_head.weight" and name not in index and model.tie_word_embeddings:
                src = "model.embed_tokens.weight"
            index.fill(src, params[name])
        bar = tqdm(range(config.num_hidden_layers), desc="Loading weights", unit="layer", disable=not progress)
        for i in bar:
            for name in by_layer.get(i, []):
                for src, dst in model.checkpoint_parts(name, params[name]):
                    index.fill(src, dst)
            layer = model.model.layers[i]
            if layer.is_moe:
                block = getattr(layer, spec.moe_module)
                dev = expert_device(i) if expert_device else device
                weights = read_expert_weights(index, spec, i, config.hidden_size, dtype, dev) if read_experts else None
                block.experts = make_experts(weights, i)
    model.eval()
    return model


def read_expert_weights(
    index: SafetensorsIndex | DummyWeights, spec: ArchSpec, layer: int, hidden: int, dtype: torch.dtype, device: torch.device
) -> ExpertWeights:
    """Stack one layer's per-expert tensors: gate_up [E, 2I, H], down [E, H, I]."""
    e_n, i_n = spec.num_experts, spec.moe_intermediate
    gate_up = torch.empty(e_n, 2 * i_n, hidden, dtype=dtype, device=device)
    down = torch.empty(e_n, hidden, i_n, dtype=dtype, device=device)
    if isinstance(index, DummyWeights):  # random benchmark weights: one draw per tensor, not per expert
        g, _, d = spec.expert_tensor_names(layer, 0)
        index.fill(g, gate_up)
        index.fill(d, down)
        return ExpertWeights(gate_up=gate_up, down=down)
    for e in range(e_n):
        g, u, d = spec.expert_tensor_names(layer, e)
        index.fill(g, gate_up[e, :i_n])
        index.fill(u, gate_up[e, i_n:])
        index.fill(d, down[e])
    return ExpertWeights(gate_up=gate_up, down=down)
