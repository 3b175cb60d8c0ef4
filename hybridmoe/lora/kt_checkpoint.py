"""Read and check a KTransformers SFT output directory (the input of `hybridmoe convert-lora`) from
its safetensors headers only (no tensor is loaded here): every key, dim and rank is checked, and the
result maps each output tensor of the PEFT adapter to the input tensor whose bytes it is.

Input (INPUT/):
    fused_expert_lora.safetensors  required; keys exactly layers.{L}.experts.{gate,up,down}_lora_{a,b},
        3-D, dim 0 = E: gate/up A [E, r, H], gate/up B [E, I, r], down A [E, r, I], down B [E, H, r]
    adapter_model.safetensors      optional; a PEFT LoRA on non-expert linears, keys with or without
        `base_model.model.`, with KTransformers' wrapper component `orig_module` anywhere
    adapter_config.json            optional; lora_alpha, r, target_modules
Output keys, without `base_model.model.` (the form of the issue; PEFT (0.21 checked), SGLang and
hybridmoe's read_adapter load it, as they load the prefixed form):
    model.layers.{L}.mlp.experts.{e}.{gate|up|down}_proj.lora_{A|B}.weight
and the non-expert keys normalized to the same form (model.layers.{L}.<module>.lora_{A|B}.weight)
with A [r, in] = A_fused[e] and B [out, r] = B_fused[e]: slices of the fused tensors, so the bytes are
copied unchanged (dtype kept, scaling alpha / r not folded in).

Legend: E experts, r rank, H hidden, I expert intermediate, L layer index.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from hybridmoe.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from hybridmoe.weights.safetensors_stream import DTYPE_SIZES, Entry

log = logging.getLogger(__name__)

FUSED_FILE = "fused_expert_lora.safetensors"
PEFT_PREFIX = "base_model.model."
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
_FUSED_KEY = re.compile(r"^layers\.(\d+)\.experts\.(gate|up|down)_lora_(a|b)$")
_FUSED_FORM = "layers.{L}.experts.{gate,up,down}_lora_{a,b}"
_LINEAR_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")
_DIM_NAMES = {"E": "experts (dim 0)", "r": "rank", "H": "hidden size", "I": "expert intermediate size"}
# the dims after E of each fused tensor
_SHAPES = {("gate", "a"): ("r", "H"), ("gate", "b"): ("I", "r"), ("up", "a"): ("r", "H"), ("up", "b"): ("I", "r"),
           ("down", "a"): ("r", "I"), ("down", "b"): ("H", "r")}


class ConvertLoRAError(ValueError):
    """A malformed input or a bad option; the message names the file and key."""


@dataclass
class Source:
    """One input tensor and the output entries its bytes become, in order (the E slices of a fused
    tensor, or a non-expert tensor as it is)."""

    file: Path
    key: str
    outputs: list[Entry]
    layer: int | None = None  # fused tensors: their layer (for the progress lines)


@dataclass
class KTInput:
    """A checked input directory: the output tensors' plan and the adapter's settings."""

    path: Path
    rank: int
    num_experts: int
    lora_alpha: float
    experts: list[Source]  # by layer, then gate/up/down, A then B
    linears: list[Source] = field(default_factory=list)
    linear_modules: set[str] = field(default_factory=set)  # last components of the non-expert tensors' modules
    config_targets: set[str] = field(default_factory=set)  # last components of adapter_config's target_modules

    @property
    def layers(self) -> list[int]:
        return sorted({s.layer for s in self.experts})


def _headers(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """key -> (safetensors dtype, shape), read from the header only."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            out = {}
            for k in f.keys():
                s = f.get_slice(k)
                out[k] = (s.get_dtype(), tuple(s.get_shape()))
            return out
    except Exception as e:  # safetensors raises its own error types (and OSError)
        raise ConvertLoRAError(f"{file}: not a readable safetensors file ({e})") from e


def _check_dtype(file: Path, key: str, dtype: str) -> None:
    if dtype not in DTYPE_SIZES:
        raise ConvertLoRAError(f"{file}: {key} has dtype {dtype}, not a tensor dtype a LoRA weight can have")


def _plan_experts(file: Path) -> tuple[list[Source], int, int]:
    """The fused tensors' output plan, E and r."""
    heads = _headers(file)
    if not heads:
        raise ConvertLoRAError(f"{file}: no tensors (expected {_FUSED_FORM})")
    dims: dict[str, tuple[int, str]] = {}  # dim name -> (value, the key that set it)
    layers: dict[int, dict[tuple[str, str], str]] = {}
    for key, (dtype, shape) in sorted(heads.items()):  # sorted: the same message whatever the file's order
        m = _FUSED_KEY.match(key)
        if m is None:
            raise ConvertLoRAError(f"{file}: unexpected key {key!r} (the only keys are {_FUSED_FORM})")
        if len(shape) != 3:
            raise ConvertLoRAError(f"{file}: {key} has shape {list(shape)}; expected a 3-D tensor [E, ...]")
        _check_dtype(file, key, dtype)
        proj, ab = m.group(2), m.group(3)
        for name, value in zip(("E", *_SHAPES[proj, ab]), shape):
            if value <= 0:
                raise ConvertLoRAError(f"{file}: {key} has shape {list(shape)}: {_DIM_NAMES[name]} {value}")
            first = dims.setdefault(name, (value, key))
            if first[0] != value:
                raise ConvertLoRAError(f"{file}: {key} has shape {list(shape)}: {_DIM_NAMES[name]} {value}, but "
                                       f"{first[1]} has {_DIM_NAMES[name]} {first[0]}")
        layers.setdefault(int(m.group(1)), {})[proj, ab] = key
    num_experts, rank = dims["E"][0], dims["r"][0]
    sources = []
    for layer in sorted(layers):
        got = layers[layer]
        missing = [f"layers.{layer}.experts.{p}_lora_{x}" for p, x in _SHAPES if (p, x) not in got]
        if missing:
            raise ConvertLoRAError(f"{file}: layer {layer} has no {', '.join(missing)} (every layer needs all six)")
        for proj, ab in _SHAPES:
            key = got[proj, ab]
            dtype, shape = heads[key]
            outs = [Entry(f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.lora_{ab.upper()}.weight",
                          dtype, shape[1:]) for e in range(num_experts)]
            sources.append(Source(file, key, outs, layer))
    return sources, num_experts, rank


def normalize_key(key: str) -> str:
    """A PEFT key without `base_model.model.`, KTransformers' `orig_module` components and peft's
    in-memory adapter name (`lora_A.default.weight`)."""
    parts = [p for p in key.removeprefix(PEFT_PREFIX).split(".") if p != "orig_module"]
    if len(parts) >= 3 and parts[-3] in ("lora_A", "lora_B") and parts[-2] == "default":
        del parts[-2]
    return ".".join(parts)


def _plan_linears(file: Path, rank: int, taken: set[str]) -> tuple[list[Source], set[str]]:
    """The non-expert tensors' output plan and their modules' last components; `taken`: the expert keys."""
    pairs: dict[tuple[int, str], dict[str, tuple[str, Entry]]] = {}
    names: dict[str, str] = {}  # output key -> input key
    for key, (dtype, shape) in sorted(_headers(file).items()):
        norm = normalize_key(key)
        m = _LINEAR_KEY.match(norm)
        if m is None:
            raise ConvertLoRAError(f"{file}: key {key!r} is not a LoRA weight of a layer's linear "
                                   "([base_model.model.]model.layers.{L}.<module>.lora_{A|B}.weight)")
        out = norm
        if out in names:
            raise ConvertLoRAError(f"{file}: duplicate key: {names[out]!r} and {key!r} are both {out}")
        if out in taken:
            raise ConvertLoRAError(f"{file}: duplicate key: {key!r} is {out}, which {FUSED_FILE} also gives")
        names[out] = key
        if len(shape) != 2:
            raise ConvertLoRAError(f"{file}: {key} has shape {list(shape)}; expected 2-D (A [r, in], B [out, r])")
        _check_dtype(file, key, dtype)
        ab = m.group(3)
        got = shape[0] if ab == "A" else shape[1]
        if got != rank:
            raise ConvertLoRAError(f"{file}: {key} has shape {list(shape)}: rank {got}, but the experts' rank "
                                   f"(in {FUSED_FILE}) is {rank}; one rank for the whole adapter")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[ab] = (key, Entry(out, dtype, shape))
    sources, modules = [], set()
    for (_, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            have, lack = ("A", "B") if "A" in ab else ("B", "A")
            raise ConvertLoRAError(f"{file}: {ab[have][0]} has no lora_{lack} partner")
        sources += [Source(file, ab[x][0], [ab[x][1]]) for x in "AB"]
        modules.add(module.rsplit(".", 1)[-1])
    return sources, modules


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def read_config(file: Path) -> dict | None:
    """adapter_config.json checked for what the conversion uses, or None when absent."""
    if not file.exists():
        return None
    try:
        cfg = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertLoRAError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise ConvertLoRAError(f"{file}: expected a JSON object, got {type(cfg).__name__}")
    for flag in ("use_dora", "use_rslora"):
        if cfg.get(flag):
            raise ConvertLoRAError(f"{file}: {flag} is not supported (plain LoRA, s = lora_alpha / r)")
    for pattern in ("rank_pattern", "alpha_pattern"):
        if cfg.get(pattern):
            raise ConvertLoRAError(f"{file}: {pattern} is not supported (one r and lora_alpha for every module)")
    if cfg.get("lora_alpha") is not None and not _positive(cfg["lora_alpha"]):
        raise ConvertLoRAError(f"{file}: lora_alpha {cfg['lora_alpha']!r}: expected a positive number")
    r = cfg.get("r")
    if r is not None and (not isinstance(r, int) or isinstance(r, bool) or r <= 0):
        raise ConvertLoRAError(f"{file}: r {r!r}: expected a positive integer")
    tm = cfg.get("target_modules")
    if tm is not None and not (isinstance(tm, list) and all(isinstance(t, str) and t for t in tm)):
        raise ConvertLoRAError(f"{file}: target_modules {tm!r}: expected a list of module names")
    return cfg


def read_input(path: str | Path, lora_alpha: float | None = None) -> KTInput:
    """Check the SFT directory at `path`; `lora_alpha` (--lora-alpha) is used when adapter_config.json
    has none. Raises ConvertLoRAError."""
    d = Path(path)
    if not d.is_dir():
        raise ConvertLoRAError(f"{d}: not a directory (expected a KTransformers SFT output directory)")
    fused, weights, cfg_file = d / FUSED_FILE, d / WEIGHTS_FILE, d / CONFIG_FILE
    if not fused.is_file():
        raise ConvertLoRAError(f"{d}: no {FUSED_FILE} (required: the fused expert LoRA)")
    cfg = read_config(cfg_file) or {}
    experts, num_experts, rank = _plan_experts(fused)
    linears, modules = [], set()
    if weights.is_file():
        linears, modules = _plan_linears(weights, rank, {e.key for s in experts for e in s.outputs})
    if linears and cfg.get("r") is not None and cfg["r"] != rank:
        raise ConvertLoRAError(f"{cfg_file}: r {cfg['r']} is not the experts' rank {rank} (in {FUSED_FILE}); "
                               "one rank for the whole adapter")
    alpha = cfg.get("lora_alpha")
    if alpha is not None:
        if lora_alpha is not None and lora_alpha != alpha:
            log.warning("--lora-alpha %s ignored: %s gives lora_alpha %s", lora_alpha, cfg_file, alpha)
    elif lora_alpha is None:
        raise ConvertLoRAError(f"{d}: no lora_alpha ({CONFIG_FILE} {'has none' if cfg_file.exists() else 'absent'}); "
                               "pass --lora-alpha")
    elif not _positive(lora_alpha):
        raise ConvertLoRAError(f"--lora-alpha {lora_alpha}: expected a positive number")
    else:
        alpha = lora_alpha
    targets = {t.rsplit(".", 1)[-1] for t in cfg.get("target_modules") or []}
    return KTInput(d, rank, num_experts, alpha, experts, linears, modules, targets)
