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
matches the end of the full module name, model.layers.{L}.<module path>).

An adapter directory is hostile input (the load route takes any path): the config is read up to a size
and its fields type-checked, the patterns run within a time budget, and the weights file's header (keys,
shapes, dtypes, ranks, the bytes its tensors take) is checked before any tensor is read. `check_adapter`
runs those checks alone, reading no tensor data: the startup check of --lora-paths and the memory plan.

Legend: r rank, E experts, H hidden, I expert intermediate.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridmoe.config import ConfigError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(.+)\.lora_([AB])(?:\.default)?\.weight$")
_EXPERT = re.compile(r"^(.+)\.experts\.(\d+)\.([A-Za-z0-9_]+)$")

GPU_LINE = "LoRA slots"  # memory-plan keys: lora/plan.py estimates them, setup.note_memory sets the real bytes
HOST_LINE = "LoRA expert slots (CPU share)"

MAX_CONFIG_BYTES = 16 << 20  # adapter configs are kilobytes; a huge one (or a sparse 1 TiB one) was read whole
# a tensor key or pattern key: real ones are under 200 characters; a 5000-digit layer number was a ValueError of
# int(), and every pattern key is compiled and run on every module
MAX_KEY_CHARS = 1024
MAX_NAME_CHARS = 256  # an adapter's name: in every log line, /v1/models card and error that names it
# rank_pattern / alpha_pattern keys are regexes, run on every module path: one that backtracks without end took
# hours per path with Python's re, which cannot be stopped. A key without repetition or alternation (a module
# name, the usual key) cannot backtrack so and runs in re; any other runs in the `regex` module, whose matches
# take a timeout: a real key matches a module path in microseconds, so one match over MATCH_TIMEOUT_S refuses
# the adapter; PATTERN_BUDGET_S bounds all of an adapter's compiling and matching (many keys times many modules)
MATCH_TIMEOUT_S = 0.1
PATTERN_BUDGET_S = 30.0
_BACKTRACKING = frozenset("*+?{|")
FLOAT32_MAX = torch.finfo(torch.float32).max  # the slots' scale is a float32; their weights float32 at most
_FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_OTHER_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
                 "I32": "int32", "U64": "uint64", "I64": "int64", "C64": "complex64"}
_JSON_TYPES = {list: "a list", str: "a string", type(None): "null", bool: "a boolean", int: "a number",
               float: "a number"}
_MISSING = object()


class LoRAAdapterError(ConfigError):
    """A malformed or unsupported adapter; the message names the file and key. A ConfigError: given by a flag,
    it is reported as that flag's one line (not as an unknown error with its type name)."""


def _show(value: object, limit: int = 80) -> str:
    """A value of the file in a message: its repr, cut (a 10 MB list must not become a 10 MB error line)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def one_line(text: object) -> str:
    """A message as one line (a path or a library's error may hold newlines)."""
    return " ".join(str(text).split())


def check_name(name: object, where: str = "") -> str:
    """`name` if requests can give it as lora_path or `model`: 1 to MAX_NAME_CHARS printable characters, no
    whitespace at its ends (SGLang's names are free-form; these are the ones a request could not name
    reliably, or that would break a log line or /v1/models). LoRAAdapterError otherwise."""
    if not (isinstance(name, str) and 0 < len(name) <= MAX_NAME_CHARS and name.isprintable() and name == name.strip()):
        raise LoRAAdapterError(f"{where}LoRA adapter name {_show(name)}: expected 1 to {MAX_NAME_CHARS} printable "
                               "characters, without whitespace at its ends")
    return name


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


def abs_max(t: torch.Tensor) -> float:
    """The largest magnitude of a floating-point tensor (0 when empty); min/max reduce without a copy."""
    if t.numel() == 0:
        return 0.0
    lo, hi = torch.aminmax(t if t.dtype.itemsize > 1 else t.float())
    return max(-float(lo), float(hi))


# ---- adapter_config.json -------------------------------------------------------------------------------
def _read_config(cfg_file: Path) -> dict:
    """The config's JSON object; LoRAAdapterError naming the file for anything else."""
    try:  # non-blocking: a FIFO put there after the directory was checked must not wait for a writer
        fd = os.open(cfg_file, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise LoRAAdapterError(f"{cfg_file}: cannot be read ({e.strerror})") from None
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LoRAAdapterError(f"{cfg_file}: {CONFIG_FILE} is not a regular file")
        try:
            data = f.read(MAX_CONFIG_BYTES + 1)  # never more: a sparse file's size says nothing
        except OSError as e:
            raise LoRAAdapterError(f"{cfg_file}: cannot be read ({e.strerror})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise LoRAAdapterError(f"{cfg_file}: {max(st.st_size, len(data))} bytes; an adapter config is at most "
                               f"{MAX_CONFIG_BYTES >> 20} MiB")
    try:
        cfg = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise LoRAAdapterError(f"{cfg_file}: not valid JSON (not UTF-8 text: byte {e.start})") from None
    except RecursionError:  # json's parser recurses per nesting level: [[[...]]] 100000 deep
        raise LoRAAdapterError(f"{cfg_file}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError, and int()'s limit on digits
        raise LoRAAdapterError(f"{cfg_file}: not valid JSON ({one_line(e)[:200]})") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"{cfg_file}: expected a JSON object, got {_JSON_TYPES.get(type(cfg), 'a value')}")
    return cfg


class _Patterns:
    """rank_pattern / alpha_pattern: module regex -> a positive integer rank / a finite alpha, matched by PEFT's
    rule (the first key whose pattern matches the end of the full module name) within the adapter's budget."""

    def __init__(self, cfg: dict, name: str, cfg_file: Path, rank: bool, deadline: float) -> None:
        import regex

        self.name, self.cfg_file, self.deadline = name, cfg_file, deadline
        raw = cfg.get(name) or {}
        if not isinstance(raw, dict):
            raise LoRAAdapterError(f"{cfg_file}: {name} must map module patterns to numbers, got {_show(raw)}")
        self.items: list[tuple[str, object, bool, float]] = []  # (key, compiled, timed, value)
        for key, value in raw.items():
            self._left()
            if len(key) > MAX_KEY_CHARS:
                raise LoRAAdapterError(f"{cfg_file}: {name} key of {len(key)} characters ({_show(key, 40)}); "
                                       f"at most {MAX_KEY_CHARS}")
            timed = not _BACKTRACKING.isdisjoint(key)
            try:
                pattern = regex.compile(rf"(.*\.)?({key})$", flags=regex.VERSION0) if timed \
                    else re.compile(rf"(.*\.)?({key})$")
            except Exception as e:  # noqa: BLE001  (the compilers' errors are of several types: all mean "invalid")
                raise LoRAAdapterError(f"{cfg_file}: {name} key {_show(key)} is not a valid pattern "
                                       f"({one_line(e)[:200]})") from None
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            if rank:
                ok = ok and value == int(value) and value > 0
            if not ok:
                want = "a positive integer" if rank else "a finite number"
                raise LoRAAdapterError(f"{cfg_file}: {name}[{_show(key)}] is {_show(value)}; expected {want}")
            self.items.append((key, pattern, timed, int(value) if rank else float(value)))

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise LoRAAdapterError(f"{self.cfg_file}: {self.name}: its patterns took longer than "
                                   f"{PATTERN_BUDGET_S:g} s to match this adapter's modules")
        return left

    def value(self, module: str, default: float) -> float:
        """The value of the full module name `module` (model.layers.{L}.<path>), or `default`."""
        for key, pattern, timed, value in self.items:
            left = self._left()
            try:
                hit = pattern.match(module, timeout=min(left, MATCH_TIMEOUT_S)) if timed \
                    else pattern.match(module)  # type: ignore[attr-defined]
            except TimeoutError:
                raise LoRAAdapterError(f"{self.cfg_file}: {self.name} key {_show(key)} took longer than "
                                       f"{MATCH_TIMEOUT_S:g} s to match {module} (a pattern that backtracks without "
                                       "end?)") from None
            if hit is not None:
                return value
        return default


@dataclass
class _Config:
    file: Path
    r: int
    alpha: float
    rslora: bool
    ranks: _Patterns
    alphas: _Patterns


def _flag(cfg: dict, name: str, cfg_file: Path) -> bool:
    value = cfg.get(name)
    if value is not None and not isinstance(value, bool):  # "false" is a true string
        raise LoRAAdapterError(f"{cfg_file}: {name} must be true or false, got {_show(value)}")
    return bool(value)


def _check_config(cfg: dict, cfg_file: Path) -> _Config:
    peft_type = cfg.get("peft_type", "LORA")
    if not (isinstance(peft_type, str) and peft_type.upper() == "LORA"):
        raise LoRAAdapterError(f"{cfg_file}: peft_type {_show(peft_type)}; only LORA adapters are served")
    if _flag(cfg, "use_dora", cfg_file):
        raise LoRAAdapterError(f"{cfg_file}: use_dora is not supported (plain LoRA only)")
    rslora = _flag(cfg, "use_rslora", cfg_file)
    if cfg.get("bias", "none") not in ("none", None):
        raise LoRAAdapterError(f"{cfg_file}: bias {_show(cfg.get('bias'))}; only bias 'none' is supported")
    if cfg.get("modules_to_save"):
        raise LoRAAdapterError(f"{cfg_file}: modules_to_save {_show(cfg['modules_to_save'])} (fully trained "
                               "modules) are not supported")
    # the weights say which modules are adapted (target_modules is PEFT's recipe for making them): it is never
    # compiled or matched here, only its type checked (garbage there means a damaged file)
    targets = cfg.get("target_modules")
    if not (targets is None or isinstance(targets, str) or
            (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
        raise LoRAAdapterError(f"{cfg_file}: target_modules must be a module name pattern or a list of module "
                               f"names, got {_show(targets)}")
    r = cfg.get("r", _MISSING)
    if r is _MISSING:
        raise LoRAAdapterError(f"{cfg_file}: r is missing; expected a positive integer")
    # a float r that is a whole number is taken (some writers use floats); 4.5 was served as rank 4, "4" as 4
    if not (isinstance(r, int | float) and not isinstance(r, bool) and math.isfinite(r) and r == int(r) and r > 0):
        raise LoRAAdapterError(f"{cfg_file}: r is {_show(r)}; expected a positive integer")
    alpha = cfg.get("lora_alpha", r)
    # a NaN or infinite scaling makes every output of the adapter NaN; a string was taken by float()
    if not (isinstance(alpha, int | float) and not isinstance(alpha, bool) and math.isfinite(alpha)):
        raise LoRAAdapterError(f"{cfg_file}: lora_alpha must be a finite number, got {_show(alpha)}")
    deadline = time.monotonic() + PATTERN_BUDGET_S
    return _Config(cfg_file, int(r), float(alpha), rslora, _Patterns(cfg, "rank_pattern", cfg_file, True, deadline),
                   _Patterns(cfg, "alpha_pattern", cfg_file, False, deadline))


# ---- adapter_model.safetensors' header ---------------------------------------------------------------
@dataclass
class _Pair:
    """One module's lora_A / lora_B as the header gives them, its rank and scaling."""

    keys: dict[str, str] = field(default_factory=dict)  # "A" / "B" -> key
    shapes: dict[str, list[int]] = field(default_factory=dict)
    rank: int = 0
    scaling: float = 0.0


@dataclass
class CheckedAdapter:
    """What `check_adapter` found: the files, the config, and the modules (layer, module path) -> _Pair."""

    path: Path
    config: _Config
    weights: Path
    pairs: dict[tuple[int, str], _Pair]
    nbytes: int

    @property
    def has_experts(self) -> bool:
        return any(_EXPERT.match(module) for _, module in self.pairs)

    @property
    def max_rank(self) -> int:
        return max((p.rank for p in self.pairs.values()), default=0)


def _regular_file(d: Path, name: str) -> Path:
    f = d / name
    if f.is_file():
        return f
    if f.is_symlink() or f.exists():  # a FIFO, a directory, a symlink loop: opening one could wait forever
        raise LoRAAdapterError(f"LoRA adapter {_show(str(d), 400)}: {name} is not a regular file")
    other = " (adapter_model.bin is not read: save with safetensors)" \
        if name == WEIGHTS_FILE and (d / "adapter_model.bin").exists() else ""
    raise LoRAAdapterError(f"LoRA adapter {_show(str(d), 400)}: no {name}{other}")


def check_adapter_files(path: str | Path) -> tuple[Path, Path]:
    """(config file, weights file) of an adapter directory that passes `check_adapter` (no tensor data is
    read): the startup check of --lora-paths and --kt-expert-lora-path, before the model loads (a bad config
    found after the load cost the user the whole load, and was a traceback for some values)."""
    checked = check_adapter(path)
    return checked.config.file, checked.weights


def _adapter_files(path: str | Path) -> tuple[Path, Path]:
    """(config file, weights file) of an adapter directory; LoRAAdapterError when either is missing or not a
    regular file."""
    d = Path(path)
    try:
        if not d.is_dir():
            raise LoRAAdapterError(f"LoRA adapter {_show(str(path), 400)}: not a directory")
        return _regular_file(d, CONFIG_FILE), _regular_file(d, WEIGHTS_FILE)
    except LoRAAdapterError:
        raise
    except (OSError, ValueError) as e:  # a path too long for the OS (OSError), a NUL byte in it (ValueError)
        raise LoRAAdapterError(f"LoRA adapter {_show(str(path), 400)}: cannot be read "
                               f"({getattr(e, 'strerror', None) or one_line(e)})") from None


def _header(w_file: Path) -> dict[str, tuple[list[int], str]]:
    """key -> (shape, safetensors dtype name) from the header alone (the file is mapped, no data read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(w_file), framework="pt") as f:
            out = {}
            for key in f.keys():
                sl = f.get_slice(key)
                out[key] = (list(sl.get_shape()), str(sl.get_dtype()))
            return out
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise LoRAAdapterError(f"{w_file}: not a readable safetensors file ({one_line(e)[:200]})") from None


def _host_available() -> int | None:
    from hybridmoe.moe.memory_plan import host_available_bytes

    return host_available_bytes()


def check_adapter(path: str | Path, max_rank: int | None = None) -> CheckedAdapter:
    """Every check of an adapter directory that needs no tensor data: the files, the config, and the weights'
    header (keys, 2-D floating-point tensors, A/B pairs of the config's ranks (at most `max_rank`), finite
    scalings, the bytes they take against the host memory available). Raises LoRAAdapterError. Cheap: the
    startup check runs it on the flags' adapters before the model loads."""
    d = Path(path)
    cfg_file, w_file = _adapter_files(d)
    conf = _check_config(_read_config(cfg_file), cfg_file)
    pairs: dict[tuple[int, str], _Pair] = {}
    nbytes = 0
    for key, (shape, dt) in _header(w_file).items():
        if len(key) > MAX_KEY_CHARS:
            raise LoRAAdapterError(f"{w_file}: a key of {len(key)} characters ({_show(key, 60)}); LoRA weight keys "
                                   "are far shorter")
        m = _KEY.match(key)
        if m is None:
            raise LoRAAdapterError(f"{w_file}: key {_show(key, 200)} is not a LoRA weight "
                                   "(model.layers.{L}.<module>.lora_{A|B}.weight)")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if len(shape) != 2:
            raise LoRAAdapterError(f"{w_file}: {key} has shape {tuple(shape)}; expected 2-D")
        if dt not in _FLOAT_DTYPES:
            raise LoRAAdapterError(f"{w_file}: {key} is {_OTHER_DTYPES.get(dt, dt.lower())}; expected a "
                                   "floating-point type")
        nbytes += math.prod(shape) * _FLOAT_DTYPES[dt].itemsize
        pair = pairs.setdefault((layer, module), _Pair())
        if ab in pair.keys:  # PEFT's prefix or `.default` on one of them: which one to serve would be a guess
            raise LoRAAdapterError(f"{w_file}: {key} and {pair.keys[ab]} are one tensor (model.layers.{layer}."
                                   f"{module} lora_{ab}) given twice")
        pair.keys[ab], pair.shapes[ab] = key, shape
    for (layer, module), pair in sorted(pairs.items()):
        where = f"{w_file}: model.layers.{layer}.{module}"
        if set(pair.keys) != {"A", "B"}:
            raise LoRAAdapterError(f"{where}: lora_{'B' if 'A' in pair.keys else 'A'} is missing")
        if module.endswith(".experts"):
            raise LoRAAdapterError(f"{where}.lora_A.weight: a LoRA on the stacked expert parameters (peft's "
                                   "target_parameters form) is not supported; give per-expert keys "
                                   "(...experts.{e}.gate_proj.lora_A.weight, as convert-lora writes)")
        full = f"model.layers.{layer}.{module}"  # what PEFT matches pattern keys against
        rank = int(conf.ranks.value(full, conf.r))
        a, b = pair.shapes["A"], pair.shapes["B"]
        if a[0] != rank or b[1] != rank:
            raise LoRAAdapterError(f"{where}: lora_A {tuple(a)} and lora_B {tuple(b)} do not have rank {rank} "
                                   "(adapter_config r / rank_pattern)")
        if max_rank is not None and rank > max_rank:  # refused before its tensors are read
            raise LoRAAdapterError(f"{where}: rank {rank} exceeds --max-lora-rank {max_rank}")
        alpha = conf.alphas.value(full, conf.alpha)
        pair.rank, pair.scaling = rank, alpha / math.sqrt(rank) if conf.rslora else alpha / rank
        if not abs(pair.scaling) <= FLOAT32_MAX:  # the slots keep it as a float32: the forward failed on it
            div = f"sqrt({rank})" if conf.rslora else str(rank)
            raise LoRAAdapterError(f"{cfg_file}: the scaling of {full}, lora_alpha / r = {alpha:g} / {div}, is "
                                   "beyond the float32 range")
    if not pairs:
        raise LoRAAdapterError(f"{w_file}: no LoRA weights")
    available = _host_available()
    if available is not None and nbytes > available:  # a header may claim a terabyte (in a sparse file)
        raise LoRAAdapterError(f"{w_file}: its tensors take {nbytes / 2**30:.1f} GiB; {available / 2**30:.1f} GiB "
                               "of host memory are available")
    return CheckedAdapter(d, conf, w_file, pairs, nbytes)


def read_adapter(path: str | Path, name: str | None = None, max_rank: int | None = None) -> LoRAAdapter:
    """Parse an adapter directory (host tensors, their dtype); ranks above `max_rank` are refused before any
    tensor is read. Raises LoRAAdapterError."""
    from safetensors import SafetensorError, safe_open

    checked = check_adapter(path, max_rank)
    d, w_file = checked.path, checked.weights
    adapter = LoRAAdapter(name=name or d.name, path=str(d), rank=checked.config.r)
    try:
        with safe_open(str(w_file), framework="pt") as f:
            for (layer, module), pair in sorted(checked.pairs.items()):
                where = f"{w_file}: model.layers.{layer}.{module}"
                a, b = (_tensor(f, w_file, pair.keys[x]) for x in "AB")
                em = _EXPERT.match(module)
                if em is not None:
                    moe, e, proj = em.group(1), int(em.group(2)), em.group(3)
                    held = adapter.raw_experts.setdefault(layer, (moe, {}))
                    if held[0] != moe:
                        raise LoRAAdapterError(f"{where}: experts under both {held[0]} and {moe}")
                    held[1].setdefault(e, {})[proj] = (a, b, pair.scaling)
                else:
                    adapter.linears[(layer, module)] = LinearLoRA(A=a, B=b, scaling=pair.scaling)
    except (SafetensorError, OSError, RuntimeError, MemoryError) as e:  # changed since its check, an I/O error
        raise LoRAAdapterError(f"{w_file}: cannot be read ({one_line(e)[:200]})") from None
    adapter.rank = max(checked.config.r, adapter.max_rank)
    return adapter


def _tensor(f, w_file: Path, key: str) -> torch.Tensor:
    t = f.get_tensor(key)
    if not all_finite(t):  # served, it would make this adapter's outputs NaN
        raise LoRAAdapterError(f"{w_file}: {key} holds NaN or infinite values")
    if t.dtype == torch.float64 and abs_max(t) > FLOAT32_MAX:  # infinite in the slots (float32 at most)
        raise LoRAAdapterError(f"{w_file}: {key} holds values beyond the float32 range")
    return t


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
