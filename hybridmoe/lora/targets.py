"""Which module of our model an adapter's module path fills, and wrapping those modules.

Adapter paths are the Hugging Face module paths under model.layers.{L}; ours equal them except
q/k/v, which are the parts of one fused qkv_proj. Routed experts are not here (experts.py).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe.lora.adapter import LoRAAdapterError
from hybridmoe.lora.batch import LoRABatch
from hybridmoe.lora.linear import LoRALinear

_QKV = ("q_proj", "k_proj", "v_proj")
# linears whose weight is read directly (MLA's absorbed kv_b_proj) or that are no LoRA target (routers)
_NOT_TARGETS = ("kv_b_proj", "gate", "shared_expert_gate")


def resolve(model: nn.Module, layer: int, module: str) -> tuple[str, int] | None:
    """(our module's path, part index) for the adapter path model.layers.{layer}.{module}; None if absent."""
    name = module.rsplit(".", 1)[-1]
    if name in _NOT_TARGETS:
        return None
    prefix = f"model.layers.{layer}."
    try:
        mod = model.get_submodule(prefix + module)
    except AttributeError:
        mod = None
    if isinstance(mod, (nn.Linear, LoRALinear)) or (mod is not None and hasattr(mod, "weight")
                                                      and hasattr(mod, "in_features")):
        return prefix + module, 0
    if name in _QKV:
        parent = module.rsplit(".", 1)[0] if "." in module else ""
        fused = f"{prefix}{parent}.qkv_proj" if parent else f"{prefix}qkv_proj"
        try:
            model.get_submodule(fused)
        except AttributeError:
            return None
        return fused, _QKV.index(name)
    return None


def default_targets(model: nn.Module, names: list[str] | None = None) -> list[str]:
    """Every targetable linear of the decoder layers (routed experts excluded), or those whose last
    name component is in `names` (--lora-target-modules; q/k/v select the fused qkv_proj)."""
    out = []
    want = None if names is None or "all" in names else set(names)
    for path, mod in model.named_modules():
        if not path.startswith("model.layers.") or ".experts." in path or not isinstance(mod, nn.Linear):
            continue
        last = path.rsplit(".", 1)[-1]
        if last in _NOT_TARGETS:
            continue
        if want is not None and not (last in want or (last == "qkv_proj" and want & set(_QKV))):
            continue
        out.append(path)
    return out


def target_names(model: nn.Module) -> list[str]:
    """The names --lora-target-modules may give for this model: the last name component of each
    targetable linear (default_targets), and q_proj, k_proj, v_proj for a fused qkv_proj."""
    names: list[str] = []
    for path in default_targets(model):
        last = path.rsplit(".", 1)[-1]
        for name in (*_QKV, last) if last == "qkv_proj" else (last,):
            if name not in names:
                names.append(name)
    return names


def check_target_names(model: nn.Module, names: list[str] | None) -> None:
    """--lora-target-modules against the model's linears: a name that is none of them matched no module,
    and LoRA was then silently served on fewer modules than asked (or on none)."""
    if not names:
        return
    known = target_names(model)
    unknown = [n for n in names if n != "all" and n not in known]
    if unknown:
        arch = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
        raise LoRAAdapterError(f"--lora-target-modules {' '.join(unknown)}: no LoRA-targetable linear of this model "
                               f"({arch}) has that name; its names are "
                               f"{', '.join(known) or '(none)'}, or all")


def slot_bytes(model: nn.Module, paths: list[str], slots: int, rank: int, dtype_bytes: int) -> int:
    """Bytes of the slot buffers `wrap` gives the linears at `paths` (LoRALinear: A [S, P*R, K] and Bt
    [S, P*R, N] in the slots' dtype, a float32 scale per slot); from the modules' shapes alone, so a model on
    the meta device answers before the load."""
    total = 0
    for path in paths:
        parent_path, attr = path.rsplit(".", 1)
        mod = model.get_submodule(path)
        parts = len(model.get_submodule(parent_path).qkv_sizes) if attr == "qkv_proj" else 1
        total += slots * parts * rank * (mod.in_features + mod.out_features) * dtype_bytes + 4 * slots
    return total


def wrap(model: nn.Module, paths: list[str], slots: int, rank: int, batch: LoRABatch, dtype: torch.dtype,
         device: torch.device) -> dict[str, LoRALinear]:
    """Replace each module at `paths` by a LoRALinear around it; path -> wrapper."""
    out: dict[str, LoRALinear] = {}
    for path in paths:
        parent_path, attr = path.rsplit(".", 1)
        parent = model.get_submodule(parent_path)
        mod = getattr(parent, attr)
        if isinstance(mod, LoRALinear):
            out[path] = mod
            continue
        parts = tuple(parent.qkv_sizes) if attr == "qkv_proj" else (mod.out_features,)
        wrapped = LoRALinear(mod, mod.in_features, parts, slots, rank, batch, dtype, device)
        setattr(parent, attr, wrapped)
        out[path] = wrapped
    return out


def check_targets(model: nn.Module, adapter, wrapped: dict[str, LoRALinear]) -> dict[str, dict[int, tuple]]:
    """The adapter's non-expert tensors by our wrapped module: path -> {part: (A, B, scaling)}.
    Raises LoRAAdapterError naming the adapter file and key of a module we do not have or did not wrap."""
    out: dict[str, dict[int, tuple]] = {}
    for (layer, module), lin in adapter.linears.items():
        key = f"model.layers.{layer}.{module}.lora_A.weight"
        where = f"{adapter.path}/adapter_model.safetensors: {key}"
        hit = resolve(model, layer, module)
        if hit is None:
            raise LoRAAdapterError(f"{where}: unknown target module {module!r} for this model "
                                   f"({type(model).__name__} layer {layer})")
        path, part = hit
        if path not in wrapped:
            raise LoRAAdapterError(f"{where}: module {module!r} is not a LoRA target of this server (the targets "
                                   "are fixed at startup from --lora-paths / --lora-target-modules)")
        w = wrapped[path]
        n = w.parts[part]
        if lin.A.shape[1] != w.in_features or lin.B.shape[0] != n:
            raise LoRAAdapterError(f"{where}: lora_A {tuple(lin.A.shape)} / lora_B {tuple(lin.B.shape)} do not fit "
                                   f"the module ({n} x {w.in_features})")
        if lin.rank > w.rank:
            raise LoRAAdapterError(f"{where}: rank {lin.rank} exceeds --max-lora-rank {w.rank}")
        out.setdefault(path, {})[part] = (lin.A, lin.B, lin.scaling)
    return out
