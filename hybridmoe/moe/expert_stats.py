"""Expert activation statistics for the `frequency` placement (moe/placement.py), from `--init-expert-location`.

Statistics (`--init-expert-location`, SGLang's flag; `load_expert_counts` reads them):
- hybridmoe's own file (JSON): {"format": "hybridmoe-expert-distribution", "version": 1,
  "num_experts": E, "counts": {"<layer index>": [count of expert 0, ...], ...}};
- SGLang's expert distribution record (`/dump_expert_distribution_record` with
  `--expert-distribution-recorder-mode stat`): a `.pt` file (torch.save of a dict whose "logical_count" is
  a tensor [forward passes, layers, E] or [layers, E]; a bare such tensor as SGLang's kt wrapper also
  takes), read with torch.load(weights_only=True), which unpickles nothing but tensors and plain data; or a
  `.json` file (or, as SGLang takes, an inline JSON object as the flag's value) with "logical_count" as
  nested lists. Its rows are every layer of the model (num_hidden_layers; a non-MoE layer's row is all
  zeros) and its counts are summed over the forward passes. A "physical_to_logical_map" (SGLang's
  expert-parallel slot layout) holds no counts and is refused;
- "trivial" (SGLang's default): no statistics, which `frequency` refuses.
"""

from __future__ import annotations

import json
import logging
import math
import pickle
from pathlib import Path

import torch

log = logging.getLogger(__name__)

STATS_FORMAT = "hybridmoe-expert-distribution"
STATS_VERSION = 1
# a statistics file holds a count per expert per MoE layer: a few MB for the largest models
MAX_STATS_BYTES = 64 << 20
# SGLang's `.pt` record keeps a row per forward pass (1000 by default: [1000, 61, 384] int32 is 94 MB for
# Kimi-K2; an unbounded buffer grows with the run); its count tensor is bounded by entries too (a strided view
# of a small storage can name any shape)
MAX_PT_BYTES = 1 << 30
MAX_COUNT_ENTRIES = 1 << 26
TRIVIAL = "trivial"  # SGLang's --init-expert-location default: no statistics
_COUNT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                 torch.float32, torch.float64)


def load_expert_counts(path: str, moe_layers: list[int], num_experts: int,
                       num_layers: int | None = None) -> dict[int, list[float]]:
    """Per-layer expert activation counts from `--init-expert-location` (a file of hybridmoe's or SGLang's
    format, or SGLang's inline JSON; see the module's docstring): one non-negative finite count per expert of
    every MoE layer of the model. `num_layers`: the model's layers (num_hidden_layers), the rows of an SGLang
    record (None: the last MoE layer's index + 1). Errors (ValueError) are one line naming the file and what
    was expected."""
    if path == TRIVIAL:
        raise ValueError("--init-expert-location trivial: holds no activation statistics (SGLang's default: "
                         "experts where they are); give a statistics file")
    where, data, torch_file = _read_stats(path)
    if isinstance(data, dict) and data.get("format") == STATS_FORMAT:
        counts = _hybridmoe_counts(where, data, moe_layers, num_experts)
    else:
        rows_of = num_layers if num_layers is not None else max(moe_layers, default=-1) + 1
        counts = _sglang_counts(where, data, torch_file, moe_layers, num_experts, rows_of)
    if not any(any(row) for row in counts.values()):
        log.warning("%s: every count is 0 (no activations recorded): the frequency placement is the uniform one",
                    where)
    return counts


def is_inline_json(value: str) -> bool:
    """An --init-expert-location value that is a JSON object, not a file's name (a name too long for the file
    system, as a long inline object is, names no file)."""
    if not value.lstrip().startswith("{"):
        return False
    try:
        return not Path(value).exists()
    except OSError:
        return True


def _read_stats(value: str) -> tuple[str, object, bool]:
    """(what errors name, the parsed contents, whether they came from a torch file)."""
    if is_inline_json(value):  # SGLang takes an inline JSON object too
        where = "--init-expert-location <inline JSON>"
        if len(value) > MAX_STATS_BYTES:
            raise ValueError(f"{where}: {len(value)} characters, more than a statistics file can be "
                             f"({MAX_STATS_BYTES >> 20} MiB)")
        return where, _parse_json(where, value), False
    p = Path(value)
    # (a value of any length reaches here: an error line shows at most 200 characters of it)
    where = f"--init-expert-location {value if len(value) <= 200 else value[:200] + f'... ({len(value)} characters)'}"
    torch_file = p.suffix == ".pt"
    limit = MAX_PT_BYTES if torch_file else MAX_STATS_BYTES
    try:
        size = p.stat().st_size
        if size > limit:  # read whole: a huge (or sparse) file took its size in memory
            raise ValueError(f"{where}: {size} bytes, more than a statistics file can be ({limit >> 20} MiB)")
        if torch_file:
            return where, _load_torch(where, p), True
        text = p.read_text()
    except OSError as e:  # (strerror: str(e) repeats the whole file name)
        raise ValueError(f"{where}: cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: cannot be read as JSON: {e}") from None
    return where, _parse_json(where, text), False


def _parse_json(where: str, text: str) -> object:
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{where}: cannot be read as JSON: {e}") from None
    except RecursionError:  # json's parser recurses per nesting level: [[[...]]] 100000 deep
        raise ValueError(f"{where}: cannot be read as JSON: nested too deeply") from None


def _load_torch(where: str, p: Path) -> object:
    """torch.load with weights_only=True: tensors and plain data only; any other object is refused, never built."""
    try:
        with open(p, "rb") as f:
            head = f.read(4)
        if head != b"PK\x03\x04" and not head.startswith(b"\x80"):  # torch.save: a zip archive (old: a pickle)
            raise ValueError(f"{where}: cannot be read as a torch file (torch.save output): not a zip archive "
                             f"or pickle{' (empty)' if not head else ''}")
        return torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message: a paragraph on weights_only, what was refused, a pointer to the docs
        paras = [" ".join(x.split()) for x in str(e).split("\n\n") if x.strip()]
        detail = " ".join(paras[1:-1] if len(paras) > 2 else paras[-1:])[:200]
        raise ValueError(f"{where}: refused by torch.load(weights_only=True), which reads only tensors and plain "
                         f"data: {detail or type(e).__name__}") from None
    except OSError as e:
        raise ValueError(f"{where}: cannot be read: {e}") from None
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001  (truncated or not a torch file: RuntimeError, EOFError, KeyError, ...)
        first = " ".join(str(e).split(". ")[0].split())[:200]
        raise ValueError(f"{where}: cannot be read as a torch file (torch.save output): "
                         f"{type(e).__name__}{': ' + first if first else ''}") from None


def _hybridmoe_counts(where: str, data: dict, moe_layers: list[int], num_experts: int) -> dict[int, list[float]]:
    if data.get("version", STATS_VERSION) != STATS_VERSION:
        raise ValueError(f"{where}: version {data.get('version')!r}, this hybridmoe reads version {STATS_VERSION}")
    if data.get("num_experts") != num_experts or isinstance(data.get("num_experts"), bool):
        raise ValueError(f"{where}: recorded for {data.get('num_experts')!r} experts per layer, the model has "
                         f"{num_experts}")
    raw = data.get("counts")
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: field 'counts' is {type(raw).__name__}, expected an object of MoE layer index "
                         f"-> {num_experts} counts")
    counts: dict[int, list[float]] = {}
    for key, row in raw.items():
        try:
            layer = int(key)
        except ValueError:
            layer = None
        if layer not in moe_layers:  # recorded for another model (or not by the recorder)
            raise ValueError(f"{where}: counts for layer {key!r}, which is not a MoE layer of the model (expected "
                             f"the MoE layers {moe_layers})")
        if not (isinstance(row, list) and len(row) == num_experts and all(map(_is_count, row))):
            raise ValueError(f"{where}: counts of layer {key}: expected a list of {num_experts} non-negative finite "
                             f"numbers, got {str(row)[:80]}")
        counts[layer] = row
    missing = [layer for layer in moe_layers if layer not in counts]
    if missing:
        raise ValueError(f"{where}: no counts for MoE layer(s) {missing}")
    return counts


def _is_count(c: object) -> bool:
    return (isinstance(c, (int, float)) and not isinstance(c, bool) and c >= 0
            and (isinstance(c, int) or math.isfinite(c)))


def _sglang_counts(where: str, data: object, torch_file: bool, moe_layers: list[int], num_experts: int,
                   num_layers: int) -> dict[int, list[float]]:
    """The MoE layers' rows of an SGLang record's logical_count, summed over its forward passes."""
    if isinstance(data, dict) and "logical_count" in data:
        raw = data["logical_count"]
    elif isinstance(data, dict) and "physical_to_logical_map" in data:
        raise ValueError(f"{where}: holds SGLang's physical_to_logical_map (an expert-parallel layout of expert "
                         "slots), not activation counts: the frequency placement needs a record with "
                         "'logical_count' (--expert-distribution-recorder-mode stat) or hybridmoe's own file")
    elif torch_file and isinstance(data, torch.Tensor):  # a bare count tensor, as SGLang's kt wrapper takes
        raw = data
    else:
        what = f"an object with keys {sorted(map(str, data))[:8]}" if isinstance(data, dict) else \
            type(data).__name__
        raise ValueError(f"{where}: not an expert distribution file (expected a JSON object with format "
                         f"{STATS_FORMAT!r}, written by --record-expert-distribution, or SGLang's record with "
                         f"'logical_count'); got {what}")
    want = (f"[layers, experts] or [forward passes, layers, experts] counts with {num_layers} layers (the "
            f"model's num_hidden_layers) and {num_experts} experts")
    if isinstance(raw, torch.Tensor):
        rows = _tensor_rows(where, raw, want, num_layers, num_experts)
    elif isinstance(raw, list):
        rows = _list_rows(where, raw, want, num_layers, num_experts)
    else:
        raise ValueError(f"{where}: 'logical_count' is {type(raw).__name__}, expected {want}")
    others = [i for i, row in enumerate(rows) if i not in moe_layers and any(row)]
    if others:  # SGLang records nothing there: another model's record
        raise ValueError(f"{where}: counts for layer {others[0]}, which is not a MoE layer of the model (expected "
                         f"counts only in the MoE layers {moe_layers})")
    return {layer: rows[layer] for layer in moe_layers}


def _tensor_rows(where: str, t: torch.Tensor, want: str, num_layers: int, num_experts: int) -> list[list[float]]:
    if t.layout != torch.strided or t.is_quantized or t.dtype not in _COUNT_DTYPES:
        raise ValueError(f"{where}: 'logical_count' is a {str(t.dtype).removeprefix('torch.')} "
                         f"{str(t.layout).removeprefix('torch.')} tensor, expected integer or floating counts")
    if t.dim() not in (2, 3) or tuple(t.shape[-2:]) != (num_layers, num_experts):
        raise ValueError(f"{where}: 'logical_count' has shape {list(t.shape)}, expected {want}")
    if t.numel() > MAX_COUNT_ENTRIES:
        raise ValueError(f"{where}: 'logical_count' has {t.numel()} entries, more than a record can hold "
                         f"({MAX_COUNT_ENTRIES})")
    t = t.reshape(-1, num_layers, num_experts)
    if bool((t < 0).any()) or (t.is_floating_point() and not bool(torch.isfinite(t).all())):
        raise ValueError(f"{where}: 'logical_count' holds counts that are not non-negative finite numbers")
    if t.is_floating_point():
        total = t.sum(0, dtype=torch.float64)
        overflow = not bool(torch.isfinite(total).all())
    else:  # int64 sums wrap silently: refuse what could reach 2**63
        overflow = t.dtype == torch.int64 and t.numel() > 0 and int(t.max()) > (2**63 - 1) // t.shape[0]
        total = t.sum(0, dtype=torch.int64)
    if overflow:
        raise ValueError(f"{where}: 'logical_count': the sums of its counts over the forward passes overflow")
    return total.tolist()


def _list_rows(where: str, raw: list, want: str, num_layers: int, num_experts: int) -> list[list[float]]:
    deep = bool(raw) and isinstance(raw[0], list) and bool(raw[0]) and isinstance(raw[0][0], list)
    passes = raw if deep else [raw]
    total: list[list[float]] = [[0] * num_experts for _ in range(num_layers)]
    for step in passes:
        if not (isinstance(step, list) and len(step) == num_layers
                and all(isinstance(row, list) and len(row) == num_experts for row in step)):
            shape = _list_shape(raw)
            got = f"has shape {shape}" if shape is not None else "is ragged (lists of unequal lengths)"
            raise ValueError(f"{where}: 'logical_count' {got}, expected {want}")
        for acc, row in zip(total, step):
            if not all(map(_is_count, row)):
                raise ValueError(f"{where}: 'logical_count': expected non-negative finite numbers, got "
                                 f"{str(row)[:80]}")
            acc[:] = [a + c for a, c in zip(acc, row)]
    if not all(isinstance(c, int) or math.isfinite(c) for row in total for c in row):
        raise ValueError(f"{where}: 'logical_count': the counts' sums are not finite")
    return total


def _list_shape(raw: object) -> list[int] | None:
    """The shape of nested lists (None: ragged), for error messages; lists nested past 4 levels count as one."""
    level = [raw]
    shape: list[int] = []
    while len(shape) < 4 and level and all(isinstance(x, list) for x in level):
        sizes = {len(x) for x in level}
        if len(sizes) > 1:
            return None
        shape.append(sizes.pop())
        level = [y for x in level for y in x]
    if level and any(isinstance(x, list) for x in level) and len(shape) < 4:
        return None  # lists beside numbers
    return shape
