"""A GGUF model's routed experts by layer, checked against the Hugging Face config of `--model`.

llama.cpp's names: `blk.{L}.ffn_{gate,up,down}_exps.weight`, one 3-D tensor per projection
(gate/up [E, I, H], down [E, H, I] in torch order), each projection with its own type. Every
mismatch is a GGUFError naming the file and the tensor.
"""

from __future__ import annotations

from hybridmoe.cpu.gguf_engine import GGUFExperts
from hybridmoe.cpu.gguf_quant import TYPE_IDS, TYPES
from hybridmoe.gguf.metadata import COUNT, POSITIVE, GGUFConfigError, meta_value
from hybridmoe.gguf.reader import GGUFError, GGUFModel

PROJ = ("gate", "up", "down")


def expert_name(layer: int, proj: str) -> str:
    return f"blk.{layer}.ffn_{proj}_exps.weight"


def layer_experts(model: GGUFModel, layer: int, num_experts: int, hidden: int, inter: int,
                  activation: str = "silu", model_path: str | None = None) -> GGUFExperts:
    """Layer `layer`'s experts as views of the file (checked: names, shapes, types)."""
    mats = []
    for proj in PROJ:
        name = expert_name(layer, proj)
        if not model.has(name):
            raise GGUFError(f"{model.path}: no tensor {name} (MoE layer {layer} of the model has no GGUF experts)")
        t = model.tensor(name)
        want = (num_experts, hidden, inter) if proj == "down" else (num_experts, inter, hidden)
        if t.shape != want:
            raise GGUFError(f"{t.file}: tensor {name} has shape {list(t.shape)}, the model (--model "
                            f"{_model_name(model_path)}) needs {list(want)}")
        if t.type not in TYPES:
            raise GGUFError(f"{t.file}: tensor {name} is {t.type_name}, which the CPU kernels do not support "
                            f"(supported: {', '.join(sorted(TYPE_IDS))})")
        mats.append(t)
    try:
        return GGUFExperts.of(*(t.rows() for t in mats), tuple(t.type for t in mats), activation,
                              name=f"{model.path}: blk.{layer} experts")
    except ValueError as e:
        raise GGUFError(str(e)) from None


def _model_name(model_path: str | None) -> str:
    """--model as the user gave it: the GGUF behind a view directory (gguf/view.py), else the path."""
    if model_path is None:
        return "config"
    from hybridmoe.gguf.view import gguf_source

    return gguf_source(model_path) or model_path


def check_layer_count(model: GGUFModel, num_layers: int, model_path: str | None = None) -> None:
    """The file's block count (metadata, else the highest blk index) must be the model's layer count."""
    try:  # a damaged count (a string, a float, 2**62) named here, not failing in int()
        n = meta_value(model.metadata, f"{model.arch}.block_count", POSITIVE, model.path)
        mtp = meta_value(model.metadata, f"{model.arch}.nextn_predict_layers", COUNT, model.path) or 0
    except GGUFConfigError as e:
        raise GGUFError(str(e)) from None
    if n is None:
        idx = [int(k.split(".")[1]) for k in model.tensors if k.startswith("blk.") and k.split(".")[1].isdigit()]
        n = max(idx) + 1 if idx else 0
    n -= mtp  # MTP blocks: not decoder layers
    if n != num_layers:
        raise GGUFError(f"{model.path}: {n} layers ({model.arch}.block_count), but --model "
                        f"{_model_name(model_path)} has {num_layers}")


def open_for_model(path: str, config, spec, source: str = "--kt-weight-path",
                   model_path: str | None = None) -> GGUFModel:
    """The GGUF at `path` checked against the model: layer count, and every MoE layer's three expert
    tensors (names, shapes, supported types). Reads only the headers (the tensors stay mapped)."""
    model = GGUFModel.open(path)
    check_layer_count(model, int(config.num_hidden_layers), model_path)
    for layer in spec.moe_layers:
        layer_experts(model, layer, spec.num_experts, int(config.hidden_size), spec.moe_intermediate,
                      model_path=model_path)
    return model
