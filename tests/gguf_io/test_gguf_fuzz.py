"""Damaged GGUF files beyond the tensor infos of test_gguf_damaged.py: the file's start, truncation,
the metadata's lengths, counts, type codes and values, the tokenizer's metadata and split sets.

Every case is started the way `hybridmoe generate` and `serve` start (EngineArgs adopts a GGUF
--model as its view directory, startup.prepare checks config, tokenizer, weights and the GGUF
experts), in-process, and must either start or be refused with one line naming the file (and the
key or tensor where one is to blame): never a traceback's ValueError, IndexError or
ZeroDivisionError, a hang, or a file read with its bytes in the wrong place. The fuzz part cuts the
session's tiny Qwen3-MoE GGUF at fixed and seeded offsets and overwrites seeded header numbers
(lengths, counts, type codes, dimensions) with extreme values; the rest pins each defect found.

Before gguf/header.py and gguf/metadata.py: an array count of 2**32 or 2**62, an array of arrays and
a block_count of 2**62 hung (the first three filling memory); a string where a count belongs, a head
count of 0 and a file named `-00001-of-00000` escaped as ValueError, TypeError, ZeroDivisionError
and IndexError; a big-endian file was served with its bytes swapped; `-00003-of-00002` served the
other two files; rope.freq_base 0 and a wrong expert_count were served.
"""

from __future__ import annotations

import random
import re
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter

from hybridmoe.config import ConfigError, EngineArgs
from hybridmoe.gguf.reader import GGUFError, GGUFModel
from hybridmoe.startup import prepare
from hybridmoe.weights.errors import CheckpointError

pytestmark = pytest.mark.timeout(30)  # a hang is a failure here, not a stalled run
V = GGUFValueType
A = "qwen3moe"
SEED = 20240607
N_MUTATIONS = 36
EXTREMES = (0, 1, 0xFF, 2**31, 2**32 - 1, 2**32, 2**62, 2**63, 2**64 - 1)
# what the package's reader and int() said in place of a reason (inside "not a readable GGUF file (...)")
LEAKED = ("out of bounds", "cannot reshape", "larger dtype", "values to unpack", "invalid literal", "is not a valid GGUF",
          "is not a valid GGML")


# ---- helpers ------------------------------------------------------------------------------------
def _startup(model: Path, **flags) -> None:
    """What the CLI runs before loading anything (cli._generate, launch_server.serve_main)."""
    prepare(EngineArgs.from_kwargs(model_path=str(model), device="cpu", **flags))


def _check(msg: str, named: Path, words: tuple[str, ...] = ()) -> str:
    """`msg` is one line naming the file `named`, has `words` outside its paths (a test's temporary
    directory is named after the test) and no library's words in place of a reason."""
    assert named.name in msg and "\n" not in msg, msg
    text = re.sub(r"/\S+/", "/", msg)
    assert all(w in text for w in words) and not any(w in text for w in LEAKED), msg
    return text


def _refusal(model: Path, *words: str, named: Path | None = None, **flags) -> str:
    """The error starting `model` gives: the project's one-line type, naming `named` (default the
    model) and holding `words` (the message without its directories)."""
    with pytest.raises((ConfigError, CheckpointError)) as e:
        _startup(model, **flags)
    return _check(str(e.value), named or model, words)


def _experts_flags(bad: Path) -> dict[str, str]:
    """`bad` as --kt-weight-path (the GGUF experts beside a Hugging Face --model)."""
    return {"kt_method": "LLAMAFILE", "kt_weight_path": str(bad)}


def _started_or_refused(bad: Path, hf: Path | None = None) -> str | None:
    """None if `bad` (as --model, or as --kt-weight-path beside `hf`) starts, else its error, checked
    as _refusal checks it."""
    try:
        _startup(hf or bad, **(_experts_flags(bad) if hf else {}))
    except (ConfigError, CheckpointError) as e:
        return _check(str(e), bad)
    return None


@dataclass
class Layout:
    """Where the session GGUF's header numbers are (byte offset, width), from the package's reader."""

    raw: bytes
    field: dict[str, list[tuple[int, int]]]  # key or tensor name -> its first parts
    data_offset: int
    # every length, count, type code and value of the metadata (with the version and the counts), and
    # every name length, dimension, type and offset of the tensor infos
    numbers: tuple[list[tuple[int, int]], list[tuple[int, int]]]
    tensors: list[tuple[str, int, int]]  # (name, data start, data end) in the file


def _layout(path: Path) -> Layout:
    r = GGUFReader(str(path))
    base = r.data.ctypes.data

    kv, infos = list(r.fields.values()), [t.field for t in r.tensors]
    field = {f.name: [(p.ctypes.data - base, p.nbytes) for p in f.parts[:8]] for f in kv + infos}  # a 4096-token
    # array has thousands of parts; its first ones are its length, count and first strings

    def numbers(fields) -> list[tuple[int, int]]:
        return sorted({(p.ctypes.data - base, p.nbytes) for f in fields for p in f.parts[:8]
                       if p.dtype != np.uint8 and p.nbytes in (4, 8)})

    tensors = [(t.name, int(t.data_offset), int(t.data_offset) + int(t.n_bytes)) for t in r.tensors]
    return Layout(path.read_bytes(), field, int(r.data_offset), (numbers(kv), numbers(infos)), tensors)


@pytest.fixture(scope="module")
def layout(qwen3_gguf) -> Layout:
    return _layout(qwen3_gguf[1])


def _patched(layout: Layout, out: Path, *edits: tuple[int, bytes], cut: int | None = None) -> Path:
    data = bytearray(layout.raw[:cut] if cut is not None else layout.raw)
    for at, b in edits:
        data[at:at + len(b)] = b
    out.write_bytes(bytes(data))
    return out


def _with_metadata(src: Path, out: Path, set_: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A copy of `src` with metadata values replaced ((value, type[, item type]) by key) or dropped."""
    set_ = dict(set_ or {})
    r = GGUFReader(str(src))
    w = GGUFWriter(str(out), A)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture" or f.name in drop:
            continue
        value, typ, *item = set_.pop(f.name, (f.contents(), f.types[0], f.types[-1]))
        w.add_key_value(f.name, value, typ, sub_type=item[0] if item and typ == V.ARRAY else None)
    for k, (value, typ, *item) in set_.items():
        w.add_key_value(k, value, typ, sub_type=item[0] if item else None)
    for t in r.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in r.tensors:
        w.write_tensor_data(t.data)
    w.close()
    return out


def _u32(v: int) -> bytes:
    return struct.pack("<I", v)


def _u64(v: int) -> bytes:
    return struct.pack("<Q", v)


# ---- fuzz: cuts and header numbers --------------------------------------------------------------
def _cut_points(layout: Layout) -> dict[str, int]:
    """Named cut offsets: inside the header, each kind of metadata, the tensor infos and the data."""
    f, first, last = layout.field, layout.tensors[0][0], layout.tensors[-1][0]
    _, start, end = layout.tensors[len(layout.tensors) // 2]
    points = {
        "empty": 0, "in_magic": 3, "in_version": 6, "in_counts": 20,
        "in_first_key": f["general.architecture"][1][0] + 3,
        "in_a_count_value": f[f"{A}.block_count"][3][0] + 2,
        "in_token_strings": f["tokenizer.ggml.tokens"][6][0] + 1,
        "in_token_types": f["tokenizer.ggml.token_type"][5][0] + 400,
        "in_merges": f["tokenizer.ggml.merges"][6][0] + 20_000,
        "in_chat_template": f["tokenizer.chat_template"][4][0] + 50,
        "in_first_tensor_info": f[first][1][0] + 2, "in_last_tensor_info": f[last][3][0] + 4,
        "in_the_padding": layout.data_offset - 1, "at_the_data": layout.data_offset,
        "in_the_first_tensor": layout.data_offset + 100, "mid_data": (start + end) // 2,
        "last_byte_missing": len(layout.raw) - 1,
    }
    rng = random.Random(SEED)
    return points | {f"seeded_{i}": rng.randrange(len(layout.raw)) for i in range(6)}


CUTS = ("empty", "in_magic", "in_version", "in_counts", "in_first_key", "in_a_count_value", "in_token_strings",
        "in_token_types", "in_merges", "in_chat_template", "in_first_tensor_info", "in_last_tensor_info",
        "in_the_padding", "at_the_data", "in_the_first_tensor", "mid_data", "last_byte_missing",
        *(f"seeded_{i}" for i in range(6)))


@pytest.mark.parametrize("where", CUTS)
def test_a_truncated_file_is_refused_naming_it(where, layout, qwen3_gguf, tmp_path):
    hf = qwen3_gguf[0]
    bad = _patched(layout, tmp_path / f"cut-{where}.gguf", cut=_cut_points(layout)[where])
    assert "truncated" in _refusal(bad)  # an incomplete download says so, wherever it stopped
    _refusal(hf, "truncated", named=bad, **_experts_flags(bad))


def _mutation(layout: Layout, rng: random.Random) -> tuple[int, bytes]:
    """(offset, new bytes): a number of the metadata, one of the tensor infos, or any header bytes (a
    third each), set to an extreme or random value."""
    region = rng.randrange(3)
    if region < 2:
        at, width = rng.choice(layout.numbers[region])
    else:
        at, width = rng.randrange(layout.data_offset - 8), rng.choice((1, 4, 8))
    value = rng.choice((*EXTREMES, rng.getrandbits(64))) % 2 ** (8 * width)
    return at, value.to_bytes(width, "little")


@pytest.mark.parametrize("i", range(N_MUTATIONS))
def test_a_damaged_header_number_starts_or_is_refused_naming_the_file(i, layout, qwen3_gguf, tmp_path):
    rng = random.Random(SEED + i)
    at, new = _mutation(layout, rng)
    bad = _patched(layout, tmp_path / f"mutation-{i}.gguf", (at, new))
    # a value that still describes a servable model (a token's text, a count set to what it was) may start
    _started_or_refused(bad, qwen3_gguf[0] if i % 4 == 3 else None)  # every 4th as the experts of --model HF


# ---- the header's structure, named --------------------------------------------------------------
def _header_cases(layout: Layout) -> dict[str, tuple[tuple[int, bytes], tuple[str, ...]]]:
    f, first = layout.field, layout.tensors[0][0]
    return {
        "magic": ((0, b"GGUX"), ("not the GGUF magic",)),
        "version": ((4, _u32(4)), ("version 4",)),
        "big_endian": ((4, struct.pack(">I", 3)), ("big-endian",)),
        "tensor_count": ((8, _u64(2**62)), ("4611686018427387904 tensor entries",)),
        "metadata_count": ((16, _u64(2**62)), ("metadata entries",)),
        "key_length": ((f[f"{A}.block_count"][0][0], _u64(2**62)), ("metadata entry 1", "more than any name")),
        "key_not_utf8": ((f[f"{A}.block_count"][1][0], b"\xff"), ("metadata entry 1", "not UTF-8")),
        "value_type": ((f[f"{A}.block_count"][2][0], _u32(99)), (f"metadata {A}.block_count", "type code 99")),
        "string_length": ((f["tokenizer.ggml.model"][3][0], _u64(2**62)), ("metadata tokenizer.ggml.model",)),
        # these three hung in the package's reader: it loops over the count without advancing
        "array_count_2**62": ((f["tokenizer.ggml.token_type"][4][0], _u64(2**62)),
                              ("metadata tokenizer.ggml.token_type", "4611686018427387904 INT32 values")),
        "array_count_2**32": ((f["tokenizer.ggml.token_type"][4][0], _u64(2**32)),
                              ("metadata tokenizer.ggml.token_type", "4294967296 INT32 values")),
        "array_of_arrays": ((f["tokenizer.ggml.token_type"][3][0], _u32(9)), ("token_type", "array of arrays")),
        "array_item_type": ((f["tokenizer.ggml.token_type"][3][0], _u32(99)), ("token_type", "item type code 99")),
        "string_array_count": ((f["tokenizer.ggml.tokens"][4][0], _u64(2**62)), ("tokenizer.ggml.tokens",)),
        "tensor_name_length": ((f[first][0][0], _u64(2**62)), ("tensor info 0", "more than any name")),
        "tensor_name_not_utf8": ((f[first][1][0], b"\xff"), ("tensor info 0", "not UTF-8")),
        "tensor_dimensions": ((f[first][2][0], _u32(5)), (f"tensor {first}", "5 dimensions")),
        "tensor_dimension": ((f[first][3][0], _u64(2**62)), (f"tensor {first}", "2**63 elements")),
        "tensor_type": ((f[first][4][0], _u32(99)), (f"tensor {first}", "type code 99")),
    }


HEADER_CASES = ("magic", "version", "big_endian", "tensor_count", "metadata_count", "key_length", "key_not_utf8",
                "value_type", "string_length", "array_count_2**62", "array_count_2**32", "array_of_arrays",
                "array_item_type", "string_array_count", "tensor_name_length", "tensor_name_not_utf8",
                "tensor_dimensions", "tensor_dimension", "tensor_type")


@pytest.mark.parametrize("case", HEADER_CASES)
def test_a_damaged_header_is_refused_naming_the_field(case, layout, qwen3_gguf, tmp_path):
    edit, words = _header_cases(layout)[case]
    bad = _patched(layout, tmp_path / "bad.gguf", edit)
    _refusal(bad, "not a readable GGUF file", *words)
    with pytest.raises(GGUFError, match="not a readable GGUF file"):  # the LLAMAFILE experts' reader too
        GGUFModel.open(bad)


def test_a_truncated_file_names_the_metadata_or_tensor_it_ends_in(layout, tmp_path):
    merges = layout.field["tokenizer.ggml.merges"][6][0] + 1000
    _refusal(_patched(layout, tmp_path / "a.gguf", cut=merges), "metadata tokenizer.ggml.merges", "truncated")
    name, start, end = layout.tensors[len(layout.tensors) // 2]
    _refusal(_patched(layout, tmp_path / "b.gguf", cut=(start + end) // 2), f"tensor {name}", "past the end")


def test_a_big_endian_file_is_not_read_with_its_bytes_swapped(tmp_path):
    """The package reads one, swapping only the numbers it knows the type of; the weights' bytes stay
    big-endian, and before the header check --kt-weight-path served such experts."""
    w = GGUFWriter(str(tmp_path / "be.gguf"), A, endianess=GGUFEndian.BIG)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.arange(8, dtype=np.float32).reshape(2, 4))  # the writer swaps it
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=r"be.gguf: not a readable GGUF file: a big-endian file"):
        GGUFModel.open(tmp_path / "be.gguf")


# ---- metadata values ----------------------------------------------------------------------------
# key -> (value, type[, item type]), what the error must say; the comment: what happened before
METADATA_CASES = {
    "block_count_text": ({f"{A}.block_count": ("three", V.STRING)}, "'three' (a string)"),  # ValueError
    "block_count_array": ({f"{A}.block_count": ([1, 2], V.ARRAY, V.INT32)}, "(an array)"),  # TypeError
    "block_count_float": ({f"{A}.block_count": (3.5, V.FLOAT32)}, "3.5 (a float)"),  # served as 3 layers
    "block_count_2**62": ({f"{A}.block_count": (2**62, V.UINT64)}, f"{A}.block_count is 4611686018427387904"),  # hang
    "block_count_past_the_tensors": ({f"{A}.block_count": (5, V.UINT32)}, "the tensors stop at blk.2"),
    "embedding_length_text": ({f"{A}.embedding_length": ("x", V.STRING)}, f"{A}.embedding_length"),  # ValueError
    "embedding_length_0": ({f"{A}.embedding_length": (0, V.UINT32)}, f"{A}.embedding_length is 0"),  # named the cache
    "embedding_length_wrong": ({f"{A}.embedding_length": (512, V.UINT32)}, "token_embd.weight has rows of 256"),
    "head_count_0": ({f"{A}.attention.head_count": (0, V.UINT32)}, f"{A}.attention.head_count is 0"),  # ZeroDivision
    "head_count_negative": ({f"{A}.attention.head_count": (-4, V.INT32)}, "head_count is -4"),  # named the cache
    "head_count_kv_text": ({f"{A}.attention.head_count_kv": ("x", V.STRING)}, "head_count_kv"),  # ValueError
    "head_count_kv_not_dividing": ({f"{A}.attention.head_count_kv": (3, V.UINT32)}, "no whole number of heads"),
    "context_length_text": ({f"{A}.context_length": ("x", V.STRING)}, f"{A}.context_length"),  # ValueError
    "context_length_2**62": ({f"{A}.context_length": (2**62, V.UINT64)}, f"{A}.context_length"),  # named the cache
    "expert_count_wrong": ({f"{A}.expert_count": (7, V.UINT32)}, "holds 10 experts"),  # served
    "expert_used_count_0": ({f"{A}.expert_used_count": (0, V.UINT32)}, f"{A}.expert_used_count is 0"),  # the cache
    "expert_used_count_text": ({f"{A}.expert_used_count": ("2", V.STRING)}, "'2' (a string)"),  # served as 2
    "rms_epsilon_text": ({f"{A}.attention.layer_norm_rms_epsilon": ("x", V.STRING)}, "layer_norm_rms_epsilon"),
    "rope_freq_base_0": ({f"{A}.rope.freq_base": (0.0, V.FLOAT32)}, f"{A}.rope.freq_base is 0.0"),  # NaN outputs
    "rope_scaling_factor_text": ({f"{A}.rope.scaling.type": ("yarn", V.STRING),
                                  f"{A}.rope.scaling.factor": ("x", V.STRING)}, "rope.scaling.factor"),  # ValueError
    "eos_token_id_past_the_vocabulary": ({"tokenizer.ggml.eos_token_id": (10**6, V.UINT32)},
                                         "tokenizer.ggml.tokens has 4096 tokens"),  # "list index out of range"
    "add_bos_token_text": ({"tokenizer.ggml.add_bos_token": ("x", V.STRING)}, "add_bos_token"),  # ValueError
}


@pytest.mark.parametrize("case", sorted(METADATA_CASES))
def test_a_damaged_metadata_value_is_refused_naming_the_key(case, qwen3_gguf, tmp_path):
    edits, words = METADATA_CASES[case]
    bad = _with_metadata(qwen3_gguf[1], tmp_path / "bad.gguf", edits)
    _refusal(bad, words)


def test_missing_metadata_is_refused_naming_the_key(qwen3_gguf, tmp_path):
    src = qwen3_gguf[1]
    _refusal(_with_metadata(src, tmp_path / "a.gguf", drop=(f"{A}.block_count",)), f"{A}.block_count")
    _refusal(_with_metadata(src, tmp_path / "b.gguf", drop=("tokenizer.ggml.merges",)),
             "without tokenizer.ggml.merges")  # was "('scores')"
    _refusal(_with_metadata(src, tmp_path / "c.gguf", drop=("tokenizer.ggml.tokens",)), "no tokenizer.ggml.tokens")


def test_a_tokenizer_error_of_several_lines_is_one(qwen3_gguf, tmp_path):
    """tokenizers' error for merges that are one string spans three lines."""
    bad = _with_metadata(qwen3_gguf[1], tmp_path / "bad.gguf", {"tokenizer.ggml.merges": ("a b", V.STRING)})
    _refusal(bad, "tokenizer metadata cannot be converted")


@pytest.mark.parametrize("key", ["block_count", "nextn_predict_layers"])
def test_an_experts_file_with_a_count_of_the_wrong_type_is_refused_naming_the_key(key, qwen3_gguf, tmp_path):
    """--kt-weight-path reads the layer count itself (gguf/experts.py): int() of a string escaped."""
    hf, src, _ = qwen3_gguf
    bad = _with_metadata(src, tmp_path / "bad.gguf", {f"{A}.{key}": ("three", V.STRING)})
    _refusal(hf, f"metadata {A}.{key} is 'three'", named=bad, **_experts_flags(bad))


def test_generate_on_wrongly_typed_metadata_exits_2_with_one_line_naming_the_key(qwen3_gguf, tmp_path):
    bad = _with_metadata(qwen3_gguf[1], tmp_path / "bad.gguf", {f"{A}.block_count": ("three", V.STRING)})
    p = subprocess.run([sys.executable, "-m", "hybridmoe.cli", "generate", "--device", "cpu", "--model-path", str(bad),
                        "--max-new-tokens", "2"], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and "bad.gguf: metadata qwen3moe.block_count is 'three'" in lines[0], lines


# ---- split sets ---------------------------------------------------------------------------------
def _split(src: Path, out: Path, max_tensors: int) -> list[Path]:
    """`src` as a split set the way llama.cpp's gguf-split writes one (split.no, split.count,
    split.tensors.count in every part)."""
    r = GGUFReader(str(src))
    w = GGUFWriter(str(out), A, split_max_tensors=max_tensors)
    for f in r.fields.values():
        if not (f.name.startswith("GGUF.") or f.name == "general.architecture"):
            w.add_key_value(f.name, f.contents(), f.types[0], sub_type=f.types[-1] if f.types[0] == V.ARRAY else None)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(out.parent.glob(f"{out.stem}-*.gguf"))


@pytest.fixture(scope="module")
def split_sets(qwen3_gguf, tmp_path_factory) -> tuple[list[Path], list[Path]]:
    """The session GGUF as a set of two parts and as a set of three."""
    d = tmp_path_factory.mktemp("split")
    (d / "two").mkdir()
    (d / "three").mkdir()
    return _split(qwen3_gguf[1], d / "two" / "m.gguf", 20), _split(qwen3_gguf[1], d / "three" / "m.gguf", 14)


def test_an_intact_split_set_starts(split_sets):
    two, three = split_sets
    assert len(two) == 2 and len(three) == 3
    _startup(two[0])


def test_a_part_of_another_split_set_is_refused(split_sets, qwen3_gguf, tmp_path):
    """Part 2 of the three-part set in place of part 2 of the two-part one: it said 'not a mixture-of-
    experts model' (the view) or named a duplicated tensor (the experts' reader)."""
    two, three = split_sets
    for i, src in enumerate((two[0], three[1]), 1):
        shutil.copy(src, tmp_path / f"m-{i:05d}-of-00002.gguf")
    first, second = tmp_path / "m-00001-of-00002.gguf", tmp_path / "m-00002-of-00002.gguf"
    _refusal(first, "split.count 3", "do not belong together", named=second)
    _refusal(qwen3_gguf[0], "do not belong together", named=second, **_experts_flags(first))


def test_one_part_of_a_split_set_alone_is_refused(split_sets, tmp_path):
    shutil.copy(split_sets[1][0], tmp_path / "renamed.gguf")
    _refusal(tmp_path / "renamed.gguf", "split.count 3", "NAME-00001-of-00003.gguf")


def test_a_split_set_missing_a_tensor_by_its_count_is_refused(split_sets, tmp_path):
    """split.tensors.count in the first part against the tensors of all parts."""
    two = split_sets[0]
    for p in two:
        shutil.copy(p, tmp_path / p.name)
    first = tmp_path / two[0].name
    at = _layout(first).field["split.tensors.count"][3][0]
    data = bytearray(first.read_bytes())
    data[at:at + 4] = struct.pack("<i", 40)
    first.write_bytes(bytes(data))
    _refusal(first, "split.tensors.count 40", "39 tensors")


@pytest.mark.parametrize("name", ["m-00001-of-00000.gguf", "m-00003-of-00002.gguf"])
def test_a_split_name_outside_its_set_is_refused(name, split_sets, tmp_path):
    """-of-00000 made an empty set (IndexError); part 3 of 2 served parts 1 and 2 without reading it."""
    for p in split_sets[0]:
        shutil.copy(p, tmp_path / p.name)
    shutil.copy(split_sets[0][0], tmp_path / name)
    _refusal(tmp_path / name, "is not a part of a split set")
