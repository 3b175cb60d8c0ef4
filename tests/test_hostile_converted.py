"""Hostile CPU expert weight directories (`--kt-weight-path`, written by `hybridmoe convert`), hostile conversion
states (`convert --resume` / `--verify`) and hostile expert statistics files (`--init-expert-location`, what
`--record-expert-distribution` writes).

Each is refused with one CheckpointError / ConfigError line naming the file and what was expected: the directory's
layout, its files' presence, kind and sizes and the statistics file are checked by the startup checks
(`hybridmoe.startup.prepare`, before the model loads); a layer file's contents (header, dtypes, shapes, scales)
when it is read, after its checksum. A layer file may pass its checksum yet be hostile: the cases that damage one
write its new size and sha256 into manifest.json ("resigned"), as a hand-edited directory would.
Before, these were tracebacks from deep inside (KeyError, RuntimeError, RecursionError, AttributeError,
IndexError, TypeError), a 10 TB allocation, native kernels walking packed tensors by paddings they do not have,
NaN outputs at the first token, or placements silently built from NaN / negative counts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from hybridmoe.cli import main as cli_main
from hybridmoe.config import ConfigError, EngineArgs
from hybridmoe.convert import main as convert_main
from hybridmoe.engine.llm import LLM
from hybridmoe.moe.expert_stats import STATS_FORMAT, load_expert_counts
from hybridmoe.moe.recorder import ExpertDistributionRecorder
from hybridmoe.startup import prepare
from hybridmoe.weights.cpu_format import CPUWeightDir, CPUWeightsError
from hybridmoe.weights.errors import CheckpointError

from tiny_models import one_line

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "hybridmoe" / "demo_model"  # 4 MoE layers of 8 experts, hidden 128, moe_intermediate 256
L0 = "layer_0000.safetensors"
# every case must fail fast: a hang is a test failure, not a stuck run
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """The demo model's experts converted to int8 (AMXINT8), once per module; tests damage copies of it."""
    from hybridmoe.cpu import native

    try:
        native.lib()
    except Exception as e:  # noqa: BLE001  (no compiler, no prebuilt library: nothing here can run)
        pytest.skip(f"the native CPU library is not available: {e}")
    out = tmp_path_factory.mktemp("converted") / "int8"
    assert convert_main(["--input-path", str(DEMO), "--output", str(out), "--quant-method", "int8",
                         "--no-progress"]) == 0
    return out


def _copy(converted: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(converted, tmp_path / "w"))


def _manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


def _edit_manifest(d: Path, **changes: object) -> None:
    (d / "manifest.json").write_text(json.dumps(dict(_manifest(d), **changes)))


def _resign(d: Path, name: str = L0) -> None:
    """manifest.json given the layer file's present size and sha256 (the file passes its checksum)."""
    data = (d / name).read_bytes()
    m = _manifest(d)
    m["files"][name].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (d / "manifest.json").write_text(json.dumps(m))


def _header(d: Path, name: str = L0) -> tuple[dict, int, bytes]:
    raw = (d / name).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), n, raw


def _rewrite_header(d: Path, edit: Callable[[dict], object], name: str = L0) -> None:
    """The layer file with its header replaced by edit(header) (padded to the same length), resigned."""
    header, n, raw = _header(d, name)
    new = json.dumps(edit(header), separators=(",", ":")).encode()
    assert len(new) <= n
    (d / name).write_bytes(raw[:8] + new + b" " * (n - len(new)) + raw[8 + n:])
    _resign(d, name)


def _args(weights: Path, method: str = "AMXINT8", **kw: object) -> EngineArgs:
    return EngineArgs(model_path=str(DEMO), device="cpu", kt_weight_path=str(weights), kt_method=method, **kw)


# ---- --kt-weight-path: refused by the startup checks, before the model loads ---------------------------------
def _truncated(d: Path) -> str:
    with open(d / L0, "r+b") as f:
        f.truncate(1000)
    return L0


def _truncated_resigned(d: Path) -> str:  # the manifest agrees: 1000 bytes cannot hold the tensors (RuntimeError)
    _truncated(d)
    _resign(d)
    return "manifest.json"


def _missing(d: Path) -> str:
    (d / "layer_0002.safetensors").unlink()
    return "layer_0002.safetensors"


def _directory(d: Path) -> str:  # a directory in place of a layer file ("4096 bytes, the manifest says ...")
    (d / L0).unlink()
    (d / L0).mkdir()
    return L0


def _symlink_loop(d: Path) -> str:
    (d / L0).unlink()
    os.symlink(L0, d / L0)
    return L0


def _bytes_huge(d: Path) -> str:  # a sparse 10 TB layer file the manifest agrees with: was a 10 TB allocation
    m = _manifest(d)
    m["files"][L0]["bytes"] = 10**13
    (d / "manifest.json").write_text(json.dumps(m))
    with open(d / L0, "r+b") as f:
        f.truncate(10**13)
    return "manifest.json"


def _manifest_deep(d: Path) -> str:  # was a RecursionError
    (d / "manifest.json").write_text("[" * 100_000)
    return "manifest.json"


def _manifest_huge(d: Path) -> str:  # a sparse 1 GB manifest.json was read whole
    with open(d / "manifest.json", "r+b") as f:
        f.truncate(1 << 30)
    return "manifest.json"


def _pads(d: Path) -> str:
    """Paddings the shapes do not have, in the manifest and every layer's meta alike: the native kernels walked
    the packed tensors by them (NaN outputs from reads past the tensors; an out-of-bounds read with larger ones)."""
    for layer in range(4):
        name = f"layer_{layer:04d}.safetensors"

        def edit(h: dict) -> dict:
            h["__metadata__"]["meta"] = json.dumps(dict(json.loads(h["__metadata__"]["meta"]), hidden_pad=4096,
                                                        inter_pad=8192), sort_keys=True)
            return h

        _rewrite_header(d, edit, name)
    _edit_manifest(d, hidden_pad=4096, inter_pad=8192)
    return "manifest.json"


def _int4_group_zero(d: Path) -> str:  # was "ValueError: int4 group size must be one of ..." naming no file
    _edit_manifest(d, method="AMXINT4", quant_method="int4", group_size=0)
    return "manifest.json"


PREPARE_CASES: list[tuple[str, Callable[[Path], str], str, tuple[str, ...]]] = [
    ("truncated", _truncated, "AMXINT8", ("1000 bytes, the manifest says", "--resume")),
    ("truncated_resigned", _truncated_resigned, "AMXINT8", ("gives 1000 bytes; its tensors take",)),
    ("missing", _missing, "AMXINT8", ("cannot be read", "No such file", "--resume")),
    ("directory", _directory, "AMXINT8", ("not a regular file",)),
    ("symlink_loop", _symlink_loop, "AMXINT8", ("cannot be read", "symbolic links")),
    ("bytes_huge", _bytes_huge, "AMXINT8", (f"gives {10**13} bytes",)),
    ("manifest_deep", _manifest_deep, "AMXINT8", ("nested too deeply",)),
    ("manifest_huge", _manifest_huge, "AMXINT8", ("at most 16 MiB",)),
    ("pads", _pads, "AMXINT8", ("'hidden_pad', 'inter_pad' are 4096, 8192", "give 128, 256")),
    ("int4_group_zero", _int4_group_zero, "AMXINT4", ("'group_size' is 0, expected one of (32, 64, 128)",)),
]


@pytest.mark.parametrize(("damage", "method", "words"), [c[1:] for c in PREPARE_CASES],
                         ids=[c[0] for c in PREPARE_CASES])
def test_damaged_directory_is_refused_before_loading(converted, tmp_path, damage, method, words):
    d = _copy(converted, tmp_path)
    name = damage(d)
    with pytest.raises(CheckpointError) as e:
        prepare(_args(d, method))
    one_line(e, str(d / name), *words)


def test_method_and_model_mismatch_are_named(converted, tmp_path):
    """Guards: int4 weights served with --kt-method AMXINT8, and another model's conversion (other expert count
    and sizes), are refused at startup naming manifest.json."""
    d = _copy(converted, tmp_path)
    _edit_manifest(d, method="AMXINT4", quant_method="int4")
    with pytest.raises(CheckpointError) as e:
        prepare(_args(d))
    one_line(e, str(d / "manifest.json"), "the weights are AMXINT4", "pass --kt-method AMXINT4")
    _edit_manifest(d, method="AMXINT8", num_experts=16, hidden=64)
    with pytest.raises(CheckpointError) as e:
        prepare(_args(d))
    one_line(e, str(d / "manifest.json"), "converted for another model", "num_experts 16 (model 8)",
              "hidden 64 (model 128)")


# ---- --kt-weight-path: a layer file that passes its checksum, refused when it is read ---------------------------
def _set(tensor: str, key: str, value: object) -> Callable[[dict], dict]:
    def edit(h: dict) -> dict:
        h[tensor][key] = value
        return h
    return edit


def _meta(value: str) -> Callable[[dict], dict]:
    def edit(h: dict) -> dict:
        h["__metadata__"]["meta"] = value
        return h
    return edit


def _raw(at: int, data: bytes) -> Callable[[Path], None]:
    """The layer file with `data` written at byte `at`, resigned."""
    def damage(d: Path) -> None:
        raw = bytearray((d / L0).read_bytes())
        raw[at:at + len(data)] = data
        (d / L0).write_bytes(bytes(raw))
        _resign(d)
    return damage


def _scale(value: float, tensor: str) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        header, n, raw = _header(d)
        at = 8 + n + header[tensor]["data_offsets"][0]
        (d / L0).write_bytes(raw[:at] + struct.pack("<f", value) + raw[at + 4:])
        _resign(d)
    return damage


LOAD_CASES: list[tuple[str, Callable[[Path], None], tuple[str, ...]]] = [
    # KeyError: 'XX'
    ("dtype_unknown", lambda d: _rewrite_header(d, _set("w13.scale", "dtype", "XX")), ("tensor 'w13.scale'",)),
    # the same bytes read as int32 scales: loaded, silently wrong
    ("dtype_other", lambda d: _rewrite_header(d, _set("w13.scale", "dtype", "I32")),
     ("tensor 'w13.scale' is torch.int32 [8, 512]", "implies torch.float32 [8, 512]")),
    # RuntimeError: shape '[8, 1000]' is invalid for input of size 4096
    ("shape", lambda d: _rewrite_header(d, _set("w13.scale", "shape", [8, 1000])), ("tensor 'w13.scale'",)),
    # loaded: the view was silently clamped to the buffer's end
    ("offsets_past_end", lambda d: _rewrite_header(d, _set("w2.wsum", "data_offsets", [823296, 99_999_999])),
     ("tensor 'w2.wsum'", "fit the file")),
    ("header_length", _raw(0, struct.pack("<Q", 2**62)), ("header length 4611686018427387904",)),  # UnicodeDecode
    ("header_not_json", _raw(8, b"not json"), ("header is not valid JSON",)),  # JSONDecodeError
    ("header_list", lambda d: _rewrite_header(d, lambda h: [1, 2]), ("header is a JSON list",)),  # AttributeError
    ("meta_not_json", lambda d: _rewrite_header(d, _meta("{bad")), ("layer meta", "not a JSON object")),
    ("nan_scale", _scale(float("nan"), "w13.scale"), ("tensor 'w13.scale' holds NaN or infinite values",)),
    ("inf_scale", _scale(float("inf"), "w2.scale"), ("tensor 'w2.scale' holds NaN or infinite values",)),  # loaded
]


@pytest.mark.parametrize(("damage", "words"), [c[1:] for c in LOAD_CASES], ids=[c[0] for c in LOAD_CASES])
def test_hostile_layer_file_is_refused_when_read(converted, tmp_path, damage, words):
    """What the experts' setup does per MoE layer (moe/experts_setup.py), after the startup checks passed."""
    from hybridmoe.models.registry import arch_spec
    from hybridmoe.weights.loader import load_hf_config

    d = _copy(converted, tmp_path)
    damage(d)
    prepare(_args(d))  # the directory's layout and sizes are fine: only reading the file finds it
    config = load_hf_config(str(DEMO))
    weights = CPUWeightDir(d)
    weights.check_model(config, str(DEMO), "AMXINT8", arch_spec(config))
    with pytest.raises(CPUWeightsError) as e:
        weights.load_layer(0)
    one_line(e, str(d / L0), *words)


def test_nan_scales_stop_the_load_not_the_first_token(converted, tmp_path):
    """Through the in-process API: before, the model loaded and every request failed at its first token
    ("expert activation holds NaN or Inf")."""
    d = _copy(converted, tmp_path)
    _scale(float("nan"), "w13.scale")(d)
    with pytest.raises(CPUWeightsError) as e:
        LLM(str(DEMO), device="cpu", progress=False, kt_weight_path=str(d), kt_method="AMXINT8")
    one_line(e, str(d / L0), "holds NaN or infinite values")


def test_cli_generate_gives_one_line_and_exit_code_2(converted, tmp_path, capsys):
    d = _copy(converted, tmp_path)
    _pads(d)
    capsys.readouterr()
    rc = cli_main(["generate", "--model-path", str(DEMO), "--device", "cpu", "--kt-weight-path", str(d),
                   "--kt-method", "AMXINT8", "--max-new-tokens", "1"])
    lines = capsys.readouterr().err.splitlines()
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("hybridmoe generate: error: ") and str(d / "manifest.json") in lines[0], lines


# ---- hybridmoe convert on hostile output directories --------------------------------------------------------
def _convert(out: Path, *extra: str) -> int:
    return convert_main(["--input-path", str(DEMO), "--output", str(out), "--quant-method", "int8", "--no-progress",
                         *extra])


def _unfinished(converted: Path, tmp_path: Path) -> Path:
    """An interrupted conversion: layer 3 not done, progress.json in place of manifest.json."""
    d = _copy(converted, tmp_path)
    m = _manifest(d)
    del m["files"]["layer_0003.safetensors"]
    (d / "progress.json").write_text(json.dumps(m))
    (d / "manifest.json").unlink()
    (d / "layer_0003.safetensors").unlink()
    return d


def _convert_error(capsys, out: Path, *extra: str) -> str:
    capsys.readouterr()
    assert _convert(out, *extra) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hybridmoe convert: error: "), lines
    return lines[0]


def test_resume_of_damaged_conversion_states(converted, tmp_path, capsys):
    d = _unfinished(converted, tmp_path)
    (d / "layer_0003.safetensors.tmp").mkdir()  # was "IsADirectoryError: ..."
    err = _convert_error(capsys, d, "--resume")
    assert f"{d / 'layer_0003.safetensors.tmp'}: cannot be removed" in err and "--resume" in err
    (d / "layer_0003.safetensors.tmp").rmdir()
    (d / ".lock").mkdir()  # was "IsADirectoryError: ..."
    assert f"{d / '.lock'}: cannot be locked" in _convert_error(capsys, d, "--resume")
    (d / ".lock").rmdir()
    progress = (d / "progress.json").read_text()
    (d / "progress.json").write_text('{"a":' * 100_000)  # was a RecursionError
    assert f"{d / 'progress.json'}: damaged (not valid JSON: nested too deeply)" in _convert_error(capsys, d,
                                                                                                 "--resume")
    (d / "progress.json").write_text(progress)
    assert _convert(d, "--resume") == 0  # the same state, undamaged: resumed to a complete, loadable directory
    prepare(_args(d))
    assert _manifest(d)["files"] == _manifest(converted)["files"]


def test_verify_of_a_deeply_nested_manifest(converted, tmp_path, capsys):
    d = _copy(converted, tmp_path)
    (d / "manifest.json").write_text("[" * 100_000)
    capsys.readouterr()
    assert cli_main(["convert", "--verify", str(d)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and f"{d / 'manifest.json'}: damaged (not valid JSON: nested too deeply)" in lines[0]


@pytest.mark.parametrize("kind", ["dir", "fifo", "missing"])
def test_verify_names_what_a_layer_file_is_instead(converted, tmp_path, capsys, kind):
    """A layer file replaced by a directory or a FIFO was reported "missing" (and a FIFO must not be opened: its
    read blocks); the other layer files are still verified, and the count says one failed."""
    d = _copy(converted, tmp_path)
    f = d / L0
    f.unlink()
    if kind == "dir":
        f.mkdir()
    elif kind == "fifo":
        os.mkfifo(f)
    capsys.readouterr()
    assert cli_main(["convert", "--verify", str(d)]) == 1
    lines = capsys.readouterr().err.splitlines()
    want = {"dir": "not a regular file", "fifo": "not a regular file", "missing": "missing"}[kind]
    assert lines[0] == f"error: {f}: {want}", lines
    assert lines[1:] == [f"{d}: 1 of 4 layer file(s) failed verification"], lines


def test_output_that_is_a_file(tmp_path, capsys):
    """Guard: --output naming a file (or a path under one) is one line naming --output."""
    f = tmp_path / "afile"
    f.write_text("x")
    assert f"--output {f}: cannot be created" in _convert_error(capsys, f)
    assert f"--output {f / 'sub'}: cannot be created" in _convert_error(capsys, f / "sub")


# ---- --init-expert-location -------------------------------------------------------------------------------
def _stats(**changes: object) -> dict:
    """A valid statistics file of the demo model (4 MoE layers of 8 experts), with `changes`."""
    return dict({"format": STATS_FORMAT, "version": 1, "num_experts": 8,
                 "counts": {str(layer): [8 - e for e in range(8)] for layer in range(4)}}, **changes)


def _row(layer: int, row: object) -> dict:
    s = _stats()
    s["counts"][str(layer)] = row
    return s


def _without(layer: int) -> dict:
    s = _stats()
    del s["counts"][str(layer)]
    return s


STATS_CASES: list[tuple[str, object, str]] = [
    # (id, file contents (a str is written as is), words the error line must hold)
    ("not_json", "{oops", "cannot be read as JSON"),
    ("deep", "[" * 100_000, "nested too deeply"),  # was a RecursionError
    ("a_list", [1, 2], "not an expert distribution file"),  # was AttributeError: 'list' object has no attribute
    ("counts_list", _stats(counts=[1, 2]), "field 'counts' is list"),  # AttributeError
    ("counts_null", _stats(counts=None), "field 'counts' is NoneType"),  # AttributeError
    ("layer_key_text", _stats(counts=dict(_stats()["counts"], abc=[1] * 8)), "layer 'abc', which is not a MoE layer"),
    ("layer_of_another_model", _stats(counts=dict(_stats()["counts"], **{"99": [1] * 8})),
     "layer '99', which is not a MoE layer"),  # was accepted
    ("layer_missing", _without(2), "no counts for MoE layer(s) [2]"),
    ("row_short", _row(1, [1, 2]), "counts of layer 1: expected a list of 8"),  # IndexError
    ("row_long", _row(1, [1] * 100), "counts of layer 1: expected a list of 8"),  # was accepted
    ("row_text", _row(1, "abcdefgh"), "counts of layer 1"),  # TypeError
    ("row_null", _row(1, None), "counts of layer 1"),  # TypeError
    ("row_mixed", _row(1, [1, "a", None, [], {}, 1.5, True, 2]), "counts of layer 1"),  # TypeError
    ("negative", _row(1, [-5] * 8), "non-negative finite numbers"),  # was accepted
    ("nan", _row(1, [float("nan")] * 8), "non-negative finite numbers"),  # was accepted (arbitrary placement)
    ("inf", _row(1, [float("inf"), *range(7)]), "non-negative finite numbers"),  # was accepted
    ("experts_mismatch", _stats(num_experts=16), "recorded for 16 experts per layer, the model has 8"),
    ("experts_text", _stats(num_experts="8"), "recorded for '8' experts per layer"),
    ("version", _stats(version=2), "version 2, this hybridmoe reads version 1"),
]


def _frequency(path: Path, **kw: object) -> EngineArgs:
    return EngineArgs(model_path=str(DEMO), device="cpu", kt_num_gpu_experts=2,
                      kt_expert_placement_strategy="frequency", init_expert_location=str(path), **kw)


@pytest.mark.parametrize(("contents", "words"), [c[1:] for c in STATS_CASES], ids=[c[0] for c in STATS_CASES])
def test_malformed_statistics_file_is_refused_before_loading(tmp_path, contents, words):
    path = tmp_path / "stats.json"
    path.write_text(contents if isinstance(contents, str) else json.dumps(contents))
    with pytest.raises(ConfigError) as e:
        prepare(_frequency(path))
    one_line(e, f"--init-expert-location {path}: ", words)


def test_huge_statistics_file_is_not_read(tmp_path):
    path = tmp_path / "stats.json"
    with open(path, "wb") as f:  # sparse: 4 GB on no disk
        f.truncate(4 << 30)
    with pytest.raises(ConfigError) as e:
        prepare(_frequency(path))
    one_line(e, f"--init-expert-location {path}: {4 << 30} bytes", "64 MiB")


def test_recorded_statistics_are_accepted(tmp_path):
    """Guard: what --record-expert-distribution writes (and large integer counts) passes the checks."""
    import torch

    rec = ExpertDistributionRecorder(None, 8, torch.device("cpu"), layers=(0, 1, 2, 3))
    rec.record(1, torch.tensor([[0, 3], [3, 7]]))
    path = Path(rec.dump(str(tmp_path / "stats.json")))
    prepare(_frequency(path))
    assert load_expert_counts(str(path), [0, 1, 2, 3], 8)[1] == [1, 0, 0, 2, 0, 0, 0, 1]
    path.write_text(json.dumps(_row(2, [10**30] * 8)))
    prepare(_frequency(path))


def test_writing_statistics_leaves_a_neighbouring_tmp_file_alone(tmp_path):
    """The statistics file is written through a temporary file named after the whole file name: stats.json used
    stats.tmp, overwriting (then moving away) a user's file of that name beside it."""
    import torch

    mine = tmp_path / "stats.tmp"
    mine.write_text("mine")
    rec = ExpertDistributionRecorder(None, 8, torch.device("cpu"), layers=(0,))
    rec.record(0, torch.tensor([[1, 2]]))
    rec.dump(str(tmp_path / "stats.json"))
    assert mine.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats.json", "stats.tmp"]


def test_record_expert_distribution_into_a_directory_is_refused(tmp_path):
    """The file is written at shutdown: a directory failed it there (IsADirectoryError), after the whole run."""
    with pytest.raises(ConfigError) as e:
        prepare(EngineArgs(model_path=str(DEMO), device="cpu", record_expert_distribution=str(tmp_path)))
    one_line(e, f"--record-expert-distribution {tmp_path}: is a directory")


# ---- --init-expert-location: SGLang's expert distribution records (and its "trivial") ---------------------------
# SGLang's /dump_expert_distribution_record (--expert-distribution-recorder-mode stat) writes torch.save(dict(rank=,
# logical_count=[forward passes, layers, experts] int32, average_utilization_rate_over_window=)); a .json (or inline
# JSON) holds logical_count as nested lists. The demo model: 4 layers, all MoE, of 8 experts.
COUNTS = [[8 - e for e in range(8)], [0, 5, 5, 1, 0, 9, 2, 2], [3] * 8, [1, 0, 0, 2, 0, 0, 0, 1]]  # ties included


class _Unpickled:
    """An arbitrary object in a pickle: unpickling it would create the directory `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (str(self.marker),))


def _sglang_record(torch, passes: int = 3, dtype=None) -> dict:
    """What SGLang's stat accumulator dumps: COUNTS split over `passes` forward passes."""
    total = torch.tensor(COUNTS, dtype=dtype or torch.int32)
    steps = torch.zeros(passes, 4, 8, dtype=total.dtype)
    steps[0] = total - (total // 2) * (passes > 1)
    if passes > 1:
        steps[-1] = total // 2
    return {"rank": 0, "logical_count": steps, "average_utilization_rate_over_window": None}


def _hybridmoe_file(tmp_path: Path) -> Path:
    path = tmp_path / "own.json"
    path.write_text(json.dumps(_stats(counts={str(layer): row for layer, row in enumerate(COUNTS)})))
    return path


def test_sglang_records_give_the_counts_and_placement_of_the_same_hybridmoe_file(tmp_path):
    import torch

    from hybridmoe.moe.placement import place_experts

    own = _hybridmoe_file(tmp_path)
    steps = _sglang_record(torch)["logical_count"]
    files = {"stat.pt": _sglang_record(torch), "two_dims.pt": {"logical_count": torch.tensor(COUNTS)},
             "float.pt": _sglang_record(torch, dtype=torch.float32), "bare_tensor.pt": steps,
             "int64_one_pass.pt": _sglang_record(torch, 1, torch.int64),
             "stat.json": {"logical_count": steps.tolist()}, "two_dims.json": {"logical_count": COUNTS}}
    sources = [str(own), json.dumps({"logical_count": COUNTS})]  # SGLang takes an inline JSON object too
    for name, contents in files.items():
        path = tmp_path / name
        torch.save(contents, path) if name.endswith(".pt") else path.write_text(json.dumps(contents))
        sources.append(str(path))
    want = load_expert_counts(str(own), [0, 1, 2, 3], 8)
    assert want == {layer: row for layer, row in enumerate(COUNTS)}
    for source in sources:
        assert load_expert_counts(source, [0, 1, 2, 3], 8, num_layers=4) == want, source
        prepare(_frequency(Path(source)) if not source.startswith("{") else _frequency(source))  # type: ignore[arg-type]
        for n in (0, 1, 3, 8, [2, 3, 1, 0]):
            got = place_experts("frequency", [0, 1, 2, 3], 8, n, source, num_layers=4)
            ref = place_experts("frequency", [0, 1, 2, 3], 8, n, str(own))
            assert all(torch.equal(got[layer], ref[layer]) for layer in range(4)), (source, n)
    top3 = place_experts("frequency", [0, 1, 2, 3], 8, 3, sources[2], num_layers=4)
    assert [top3[layer].nonzero().flatten().tolist() for layer in range(4)] == [[0, 1, 2], [1, 2, 5], [0, 1, 2],
                                                                                [0, 3, 7]]


def _pt_truncated(torch, path: Path) -> None:
    torch.save(_sglang_record(torch), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


SGLANG_CASES: list[tuple[str, str, object, str]] = [
    # (id, file name, contents: a callable(torch, path) writes the file, a str or bytes is written as is, an object is
    #  torch.save'd (.pt) or json.dumps'd (.json); words the error line must hold)
    ("pt_experts", "r.pt", lambda t: {"logical_count": t.ones(2, 4, 7, dtype=t.int32)},
     "'logical_count' has shape [2, 4, 7], expected [layers, experts] or [forward passes, layers, experts] counts "
     "with 4 layers (the model's num_hidden_layers) and 8 experts"),
    ("pt_layers", "r.pt", lambda t: {"logical_count": t.ones(5, 8, dtype=t.int32)}, "has shape [5, 8], expected"),
    ("pt_one_dim", "r.pt", lambda t: {"logical_count": t.ones(8)}, "has shape [8], expected"),
    ("pt_four_dims", "r.pt", lambda t: {"logical_count": t.ones(1, 2, 4, 8)}, "has shape [1, 2, 4, 8], expected"),
    ("pt_negative", "r.pt", lambda t: {"logical_count": t.tensor([COUNTS]) - 1}, "not non-negative finite numbers"),
    ("pt_nan", "r.pt", lambda t: {"logical_count": t.full((4, 8), float("nan"))}, "not non-negative finite numbers"),
    ("pt_inf", "r.pt", lambda t: {"logical_count": t.tensor(COUNTS, dtype=t.float32).index_fill(1, t.tensor([3]),
                                                                                                float("inf"))},
     "not non-negative finite numbers"),
    ("pt_bool", "r.pt", lambda t: {"logical_count": t.ones(4, 8, dtype=t.bool)},
     "'logical_count' is a bool strided tensor, expected integer or floating counts"),
    ("pt_complex", "r.pt", lambda t: {"logical_count": t.ones(4, 8, dtype=t.complex64)}, "is a complex64"),
    ("pt_sparse", "r.pt", lambda t: {"logical_count": t.ones(4, 8).to_sparse()}, "sparse_coo tensor"),
    # a strided view of a one-element storage names 320M entries in a 2 kB file
    ("pt_huge_view", "r.pt", lambda t: {"logical_count": t.zeros(1).expand(10**7, 4, 8)},
     "has 320000000 entries, more than a record can hold"),
    ("pt_sum_overflow", "r.pt", lambda t: {"logical_count": t.full((3, 4, 8), 2**62)},
     "the sums of its counts over the forward passes overflow"),  # int64 sums wrapped to negative counts
    ("pt_no_counts", "r.pt", lambda t: {"rank": 0, "average_utilization_rate_over_window": None},
     "not an expert distribution file", "keys ['average_utilization_rate_over_window', 'rank']"),
    ("pt_physical_map", "r.pt", lambda t: {"physical_to_logical_map": t.arange(8).repeat(4, 1)},
     "holds SGLang's physical_to_logical_map", "not activation counts"),
    ("pt_counts_text", "r.pt", lambda t: {"logical_count": "abc"}, "'logical_count' is str"),
    ("pt_a_list", "r.pt", lambda t: [1, 2], "not an expert distribution file", "got list"),
    ("pt_truncated", "r.pt", _pt_truncated, "cannot be read as a torch file (torch.save output): RuntimeError"),
    ("pt_empty", "r.pt", "", "cannot be read as a torch file (torch.save output): not a zip archive or pickle "
     "(empty)"),
    ("pt_json_text", "r.pt", json.dumps({"logical_count": COUNTS}),
     "cannot be read as a torch file (torch.save output): not a zip archive or pickle"),
    ("pt_cut_pickle", "r.pt", b"\x80\x02}q\x00", "cannot be read as a torch file (torch.save output): "),
    ("json_shape", "r.json", {"logical_count": COUNTS[:3]}, "'logical_count' has shape [3, 8], expected"),
    ("json_ragged", "r.json", {"logical_count": [*COUNTS[:3], [1] * 7]}, "'logical_count' is ragged"),
    ("json_empty", "r.json", {"logical_count": []}, "'logical_count' has shape [0], expected"),
    ("json_negative", "r.json", {"logical_count": [*COUNTS[:3], [-1] * 8]}, "expected non-negative finite numbers"),
    ("json_nan", "r.json", '{"logical_count": [[NaN, 1, 1, 1, 1, 1, 1, 1]' + ", [1, 1, 1, 1, 1, 1, 1, 1]" * 3 + "]}",
     "expected non-negative finite numbers"),
    ("json_bools", "r.json", {"logical_count": [[True] * 8] * 4}, "expected non-negative finite numbers"),
    ("json_text_counts", "r.json", {"logical_count": [["a"] * 8] * 4}, "expected non-negative finite numbers"),
    ("json_null", "r.json", {"logical_count": None}, "'logical_count' is NoneType"),
    ("json_physical_map", "r.json", {"physical_to_logical_map": [list(range(8))] * 4}, "physical_to_logical_map"),
    ("json_other_object", "r.json", {"format": "other"}, "not an expert distribution file", "keys ['format']"),
]


@pytest.mark.parametrize(("name", "contents", "words"), [(c[1], c[2], c[3:]) for c in SGLANG_CASES],
                         ids=[c[0] for c in SGLANG_CASES])
def test_malformed_sglang_record_is_refused_before_loading(tmp_path, name, contents, words):
    import torch

    path = tmp_path / name
    if isinstance(contents, (str, bytes)):
        path.write_text(contents) if isinstance(contents, str) else path.write_bytes(contents)
    elif getattr(contents, "__name__", "") == "<lambda>":
        obj = contents(torch)
        torch.save(obj, path) if name.endswith(".pt") else path.write_text(json.dumps(obj))
    elif callable(contents):
        contents(torch, path)
    else:
        path.write_text(json.dumps(contents))
    with pytest.raises(ConfigError) as e:
        prepare(_frequency(path))
    one_line(e, f"--init-expert-location {path}: ", *words)


def test_a_pickled_object_is_refused_never_built(tmp_path):
    """torch.load(weights_only=True): a .pt file is read for tensors and plain data; an object's pickle (here one
    that would create a directory) is refused without running it."""
    import torch

    marker = tmp_path / "ran"
    path = tmp_path / "record.pt"
    torch.save({"logical_count": _Unpickled(marker)}, path)
    with pytest.raises(ConfigError) as e:
        prepare(_frequency(path))
    one_line(e, f"--init-expert-location {path}: refused by torch.load(weights_only=True), which reads only "
                "tensors and plain data")
    assert not marker.exists()


def test_huge_sglang_record_is_not_read(tmp_path):
    path = tmp_path / "record.pt"
    with open(path, "wb") as f:  # sparse: 2 GB on no disk
        f.truncate(2 << 30)
    with pytest.raises(ConfigError) as e:
        prepare(_frequency(path))
    one_line(e, f"--init-expert-location {path}: {2 << 30} bytes", "1024 MiB")


def test_malformed_inline_json_is_one_line():
    with pytest.raises(ConfigError) as e:
        prepare(_frequency('{"logical_count": [1, 2]}'))  # type: ignore[arg-type]
    one_line(e, "--init-expert-location <inline JSON>: 'logical_count' has shape [2], expected")
    with pytest.raises(ConfigError) as e:
        prepare(_frequency('{"logical_count": '))  # type: ignore[arg-type]
    one_line(e, "--init-expert-location <inline JSON>: cannot be read as JSON")
    # longer than a file name may be: still inline JSON (it was OSError "File name too long" from Path.exists)
    with pytest.raises(ConfigError) as e:
        prepare(_frequency('{"logical_count": [1, 2], "pad": "' + "x" * 5000 + '"}'))  # type: ignore[arg-type]
    one_line(e, "--init-expert-location <inline JSON>: 'logical_count' has shape [2], expected")
    with pytest.raises(ConfigError) as e:  # a file name too long: named, cut short, not an OSError
        prepare(_frequency("x" * 5000))  # type: ignore[arg-type]
    one_line(e, "--init-expert-location 'xxxx", "File name too long")
    assert len(str(e.value)) < 400
    with pytest.raises(ConfigError) as e:  # short components, 3000 characters: no such file, cut short too
        prepare(_frequency("a/" * 1500 + "x.json"))  # type: ignore[arg-type]
    one_line(e, "--init-expert-location a/a/", "...: no such file")
    assert len(str(e.value)) < 400


def test_trivial_is_sglang_default_and_frequency_refuses_it():
    """`--init-expert-location trivial` (SGLang's default: experts where they are) is accepted; it holds no
    statistics, so the frequency placement refuses it by name (it failed as "trivial: no such file")."""
    from hybridmoe.moe.placement import place_experts

    prepare(EngineArgs(model_path=str(DEMO), device="cpu", init_expert_location="trivial"))
    prepare(EngineArgs(model_path=str(DEMO), device="cpu", kt_num_gpu_experts=2, init_expert_location="trivial"))
    with pytest.raises(ConfigError) as e:
        EngineArgs.from_kwargs(model_path=str(DEMO), device="cpu", kt_num_gpu_experts=2,
                               kt_expert_placement_strategy="frequency", init_expert_location="trivial")
    one_line(e, "--kt-expert-placement-strategy: got 'frequency', expected --init-expert-location FILE",
             "'trivial' holds none", "uniform")
    with pytest.raises(ValueError, match="trivial holds none"):
        place_experts("frequency", [0, 1], 8, 2, "trivial")
    with pytest.raises(ValueError, match="--init-expert-location trivial: holds no activation statistics"):
        load_expert_counts("trivial", [0, 1], 8)
