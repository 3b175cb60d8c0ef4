"""Read and validate a PEFT LoRA adapter directory (what PEFT's save_pretrained and
`hybridmoe convert-lora` write): adapter_config.json + adapter_model.safetensors.

Keys, with or without PEFT's `base_model.model.` prefix:
    model.layers.{L}.<module path>.lora_A.weight   A [r, in]
    model.layers.{L}.<module path>.lora_B.weight   B [out, r]
<module path> is a non-expert linear (self_attn.q_proj, mlp.gate_proj, mlp.shared_expert.up_proj, ...)
or one routed expert's projection (<moe module>.experts.{e}.{gate|up|down}_proj, or the arch's names).
Which module paths the model has is checked when the adapter is attached (lora/targets.py).

The delta of a targeted linear is s * B (A x), s = lora_alpha / r (alpha / sqrt(r) with use_rslora);
rank_pattern / alpha_pattern give per-module ranks and scalings (PEFT's rules: a pattern key
matches the end of the module path).

Legend: r rank, E experts, H hidden, I expert intermediate.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(.+)\.lora_([AB])(?:\.default)?\.weight$")
_EXPERT = re.compile(r"^(.+)\.experts\.(\d+)\.([A-Za-z0-9_]+)$")

GPU_LINE = "LoRA slots"  # memory-plan keys: lora/plan.py estimates them, setup.note_memory sets the real bytes
HOST_LINE = "LoRA expert slots (CPU share)"

class LoRAAdapterError(ValueError):
    """A malformed or unsupported adapter; the message names the file and key."""


@dataclass
class LinearLoRA:
    """One targeted linear: A [r, in], B [out, r] (host tensors), and its scaling."""

    A: torch.Tensor
    B: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.A.shape[0]


@dataclass
class ExpertLoRA:
    """One MoE layer's routed-expert LoRA, stacked over the experts; experts without weights in
    the adapter are zero. gate/up A [E, r, H], B [E, I, r]; down A [E, r, I], B [E, H, r]."""

    gate_A: torch.Tensor
    gate_B: torch.Tensor
    up_A: torch.Tensor
    up_B: torch.Tensor
    down_A: torch.Tensor
    down_B: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.gate_A.shape[1]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.gate_A, self.gate_B, self.up_A, self.up_B, self.down_A, self.down_B


@dataclass
class LoRAAdapter:
    """A parsed adapter: non-expert linears by (layer, module path), routed experts by layer."""

    name: str
    path: str
    rank: int  # the config's r (the largest rank of its tensors with rank_pattern)
    linears: dict[tuple[int, str], LinearLoRA] = field(default_factory=dict)
    # layer -> (moe module name, {expert: {proj name: (A, B)}}) until stacked by `stack_experts`
    raw_experts: dict[int, tuple[str, dict[int, dict[str, tuple[torch.Tensor, torch.Tensor, float]]]]] = \
        field(default_factory=dict)
    experts: dict[int, ExpertLoRA] = field(default_factory=dict)

    @property
    def has_experts(self) -> bool:
        return bool(self.raw_experts or self.experts)

    @property
    def max_rank(self) -> int:
        ranks = [m.rank for m in self.linears.values()] + [e.rank for e in self.experts.values()]
        ranks += [a.shape[0] for _, per in self.raw_experts.values() for projs in per.values() for a, _, _ in
                  projs.values()]
        return max(ranks, default=0)

    def nbytes(self) -> int:
        n = sum(m.A.nbytes + m.B.nbytes for m in self.linears.values())
        return n + sum(t.nbytes for e in self.experts.values() for t in e.tensors())

    def merge(self, other: LoRAAdapter) -> None:
        """Take `other`'s tensors in (the expert half of --kt-expert-lora-path); a module in both is an error."""
        for key, m in other.linears.items():
            if key in self.linears:
                raise LoRAAdapterError(f"{other.path}: layer {key[0]} {key[1]} is also in {self.path}")
            self.linears[key] = m
        for layer, ex in other.raw_experts.items():
            if layer in self.raw_experts:
                raise LoRAAdapterError(f"{other.path}: the experts of layer {layer} are also in {self.path}")
            self.raw_experts[layer] = ex
        self.rank = max(self.rank, other.rank)


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in a floating-point LoRA tensor (fp8 has no isfinite: widened first)."""
    wide = t if t.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64) else t.float()
    return bool(torch.isfinite(wide).all())


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern: the first key that matches the end of the module path."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _patterns(cfg: dict, field: str, cfg_file: Path, rank: bool) -> dict[str, float]:
    """rank_pattern / alpha_pattern checked: module regex -> a positive integer rank / a finite alpha."""
    raw = cfg.get(field) or {}
    if not isinstance(raw, dict):
        raise LoRAAdapterError(f"{cfg_file}: {field} must map module patterns to numbers, got {raw!r}")
    out: dict[str, float] = {}
    for key, value in raw.items():
        try:
            re.compile(key)
        except re.error as e:
            raise LoRAAdapterError(f"{cfg_file}: {field} key {key!r} is not a valid pattern ({e})") from None
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if rank:
            ok = ok and value == int(value) and value > 0
        if not ok:
            want = "a positive integer" if rank else "a finite number"
            raise LoRAAdapterError(f"{cfg_file}: {field}[{key!r}] is {value!r}; expected {want}")
        out[key] = int(value) if rank else float(value)
    return out


def check_adapter_files(path: str | Path) -> tuple[Path, Path]:
    """(config file, weights file) of an adapter directory; LoRAAdapterError when either is missing. Cheap:
    the startup checks run it on the flags' adapters before the model loads."""
    d = Path(path)
    cfg_file, w_file = d / CONFIG_FILE, d / WEIGHTS_FILE
    if not d.is_dir():
        raise LoRAAdapterError(f"LoRA adapter {str(path)!r}: not a directory")
    if not cfg_file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {str(path)!r}: no {CONFIG_FILE}")
    if not w_file.is_file():
        other = " (adapter_model.bin is not read: save with safetensors)" if (d / "adapter_model.bin").exists() else ""
        raise LoRAAdapterError(f"LoRA adapter {str(path)!r}: no {WEIGHTS_FILE}{other}")
    return cfg_file, w_file


def read_adapter(path: str | Path, name: str | None = None) -> LoRAAdapter:
    """Parse an adapter directory (host tensors, their dtype). Raises LoRAAdapterError."""
    from safetensors import safe_open

    d = Path(path)
    cfg_file, w_file = check_adapter_files(d)
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"{cfg_file}: not valid JSON ({e})") from e
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAAdapterError(f"{cfg_file}: peft_type {peft_type!r}; only LORA adapters are served")
    if cfg.get("use_dora"):
        raise LoRAAdapterError(f"{cfg_file}: use_dora is not supported (plain LoRA only)")
    if cfg.get("bias", "none") not in ("none", None):
        raise LoRAAdapterError(f"{cfg_file}: bias {cfg.get('bias')!r}; only bias 'none' is supported")
    if cfg.get("modules_to_save"):
        raise LoRAAdapterError(f"{cfg_file}: modules_to_save {cfg['modules_to_save']} (fully trained modules) "
                               "are not supported")
    try:
        r = int(cfg["r"])
        alpha = float(cfg.get("lora_alpha", r))
    except (KeyError, TypeError, ValueError) as e:
        raise LoRAAdapterError(f"{cfg_file}: needs an integer `r` and a number `lora_alpha` ({e})") from e
    if r <= 0:
        raise LoRAAdapterError(f"{cfg_file}: r must be positive, got {r}")
    if not math.isfinite(alpha):  # a NaN or infinite scaling makes every output of the adapter NaN
        raise LoRAAdapterError(f"{cfg_file}: lora_alpha must be a finite number, got {alpha}")
    rslora = bool(cfg.get("use_rslora", False))
    ranks, alphas = _patterns(cfg, "rank_pattern", cfg_file, True), _patterns(cfg, "alpha_pattern", cfg_file, False)
    adapter = LoRAAdapter(name=name or d.name, path=str(d), rank=r)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(w_file), framework="pt") as f:
        for key in f.keys():
            m = _KEY.match(key)
            if m is None:
                raise LoRAAdapterError(f"{w_file}: key {key!r} is not a LoRA weight "
                                       "(model.layers.{L}.<module>.lora_{A|B}.weight)")
            layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
            t = f.get_tensor(key)
            if t.dim() != 2:
                raise LoRAAdapterError(f"{w_file}: {key} has shape {tuple(t.shape)}; expected 2-D")
            if not t.is_floating_point():
                raise LoRAAdapterError(f"{w_file}: {key} is {str(t.dtype).removeprefix('torch.')}; expected a "
                                       "floating-point type")
            if not all_finite(t):  # served, it would make this adapter's outputs NaN
                raise LoRAAdapterError(f"{w_file}: {key} holds NaN or infinite values")
            pairs.setdefault((layer, module), {})[ab] = t
    for (layer, module), ab in sorted(pairs.items()):
        where = f"{w_file}: model.layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"{where}: lora_{'B' if 'A' in ab else 'A'} is missing")
        a, b = ab["A"], ab["B"]
        if module.endswith(".experts"):
            raise LoRAAdapterError(f"{where}.lora_A.weight: a LoRA on the stacked expert parameters (peft's "
                                   "target_parameters form) is not supported; give per-expert keys "
                                   "(...experts.{e}.gate_proj.lora_A.weight, as convert-lora writes)")
        rank = int(_pattern_value(ranks, module, r))
        if a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAAdapterError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not have "
                                   f"rank {rank} (adapter_config r / rank_pattern)")
        al = float(_pattern_value(alphas, module, alpha))
        s = al / math.sqrt(rank) if rslora else al / rank
        em = _EXPERT.match(module)
        if em is not None:
            moe, e, proj = em.group(1), int(em.group(2)), em.group(3)
            held = adapter.raw_experts.setdefault(layer, (moe, {}))
            if held[0] != moe:
                raise LoRAAdapterError(f"{where}: experts under both {held[0]} and {moe}")
            held[1].setdefault(e, {})[proj] = (a, b, s)
        else:
            adapter.linears[(layer, module)] = LinearLoRA(A=a, B=b, scaling=s)
    if not adapter.linears and not adapter.raw_experts:
        raise LoRAAdapterError(f"{w_file}: no LoRA weights")
    adapter.rank = max(r, adapter.max_rank)
    return adapter


def stack_experts(adapter: LoRAAdapter, layer: int, num_experts: int, names: tuple[str, str, str],
                  hidden: int, intermediate: int) -> ExpertLoRA:
    """The layer's per-expert tensors stacked into an ExpertLoRA (zeros for experts and projections
    the adapter leaves out). names: the arch's expert projection names (gate, up, down)."""
    moe, per = adapter.raw_experts[layer]
    where = f"{adapter.path}: model.layers.{layer}.{moe}.experts"
    scalings = {s for projs in per.values() for _, _, s in projs.values()}
    if len(scalings) != 1:
        raise LoRAAdapterError(f"{where}: the experts' projections have different scalings {sorted(scalings)}; "
                               "one scaling per layer's experts is supported")
    rank = max(a.shape[0] for projs in per.values() for a, _, _ in projs.values())
    dtype = next(a.dtype for projs in per.values() for a, _, _ in projs.values())
    shapes = {names[0]: (hidden, intermediate), names[1]: (hidden, intermediate), names[2]: (intermediate, hidden)}
    out = {n: (torch.zeros(num_experts, rank, i, dtype=dtype), torch.zeros(num_experts, o, rank, dtype=dtype))
           for n, (i, o) in shapes.items()}
    for e, projs in per.items():
        if not 0 <= e < num_experts:
            raise LoRAAdapterError(f"{where}.{e}: the model's layer has {num_experts} experts")
        for proj, (a, b, _) in projs.items():
            if proj not in shapes:
                raise LoRAAdapterError(f"{where}.{e}.{proj}: unknown expert projection (this model's: "
                                       f"{', '.join(names)})")
            i, o = shapes[proj]
            if a.shape[1] != i or b.shape[0] != o:
                raise LoRAAdapterError(f"{where}.{e}.{proj}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do "
                                       f"not fit the expert ({o} x {i})")
            out[proj][0][e, :a.shape[0]] = a
            out[proj][1][e, :, :a.shape[0]] = b
    g, u, d = (out[n] for n in names)
    return ExpertLoRA(gate_A=g[0], gate_B=g[1], up_A=u[0], up_B=u[1], down_A=d[0], down_B=d[1],
                      scaling=scalings.pop())
