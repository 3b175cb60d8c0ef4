"""Open one GGUF file with the `gguf` package, after checking its header and where its tensors'
data lie.

The package trusts the header (gguf/header.py checks its structure first) and the tensor infos: a
data offset past the end of the file wraps around (numpy uint64) to some other place in it, and two
tensors may point at the same bytes, so a damaged file can load "successfully" with weights read
from the wrong place. As llama.cpp's loader does, every tensor's data must start at a multiple of the
file's alignment and lie inside the file, and the tensors must follow one another with only the
alignment padding between them (llama.cpp refuses any other layout, so every file it serves passes):
a tensor whose type or shape was damaged then overlaps its neighbour or leaves a gap.

A split set (`NAME-0000i-of-0000N.gguf`) must also be one set by its own metadata, as llama.cpp
checks it: part i says `split.no` i-1 and `split.count` N, and the parts hold `split.tensors.count`
tensors together.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from hybridmoe.gguf.header import Header, read_header
from hybridmoe.gguf.paths import GGUFPathError

if TYPE_CHECKING:
    from gguf import GGUFReader

SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def open_part(path: str | Path) -> GGUFReader:
    """The reader of the GGUF file at `path`; GGUFPathError (one line naming the file and, for a bad
    layout, the tensor) if the package cannot read it or a tensor's data is out of place."""
    from gguf import GGUFReader

    header = read_header(path)  # lengths, counts and types: the package would hang or fail in numpy's words
    check_layout(header, path)
    try:
        with warnings.catch_warnings():  # numpy overflow warnings on odd values: the checks above decide
            warnings.simplefilter("ignore", RuntimeWarning)
            r = GGUFReader(str(path), "r")
    except Exception as e:  # noqa: BLE001  (the gguf package raises several types)
        raise GGUFPathError(f"{path}: not a readable GGUF file ({' '.join(str(e).split())})") from None
    return r


def open_parts(parts: list[Path]) -> list[GGUFReader]:
    """The readers of a model's files (gguf/paths.py's split_parts), each checked by open_part and the
    set by its split metadata (GGUFPathError)."""
    readers = [open_part(p) for p in parts]
    metas = [_split_meta(r, p) for r, p in zip(readers, parts, strict=True)]
    check_split_set(parts, metas, [len(r.tensors) for r in readers])
    return readers


def _split_meta(r: GGUFReader, path: Path) -> dict[str, int]:
    """The split.* values the file has, as integers (a value of another type: GGUFPathError)."""
    out = {}
    for key in SPLIT_KEYS:
        f = r.fields.get(key)
        if f is None:
            continue
        try:
            v = f.contents()
        except Exception:  # noqa: BLE001  (undecodable: reported as the wrong type below)
            v = None
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise GGUFPathError(f"{path}: metadata {key} is {v!r}, expected a non-negative integer: the file is "
                                "damaged")
        out[key] = v
    return out


def check_split_set(parts: list[Path], metas: list[dict[str, int]], n_tensors: list[int]) -> None:
    """Part i (from 0) of n files says split.no i and split.count n, and split.tensors.count of the
    first part is the number of tensors of all of them together. A single file may not claim more
    parts: the others would be missing (one part of a set, renamed)."""
    n = len(parts)
    if n == 1:
        count = metas[0].get("split.count", 1)
        if count > 1:
            raise GGUFPathError(f"{parts[0]}: metadata split.count {count}: part {metas[0].get('split.no', 0) + 1} "
                                f"of a split set of {count} files, alone: pass the set's first part, named "
                                f"NAME-00001-of-{count:05d}.gguf, with the others beside it")
        return
    if not any(metas):  # no split metadata at all: the names alone make the set
        return
    for i, (p, m) in enumerate(zip(parts, metas, strict=True)):
        if m.get("split.count") != n or m.get("split.no") != i:
            raise GGUFPathError(f"{p}: metadata split.no {m.get('split.no')}, split.count {m.get('split.count')}; "
                                f"part {i + 1} of {n} needs {i} and {n}: the split files do not belong together")
    want = metas[0].get("split.tensors.count")
    if want is not None and want != sum(n_tensors):
        raise GGUFPathError(f"{parts[0]}: metadata split.tensors.count {want}, but the {n} parts hold "
                            f"{sum(n_tensors)} tensors: the split files do not belong together")


def check_layout(h: Header, path: str | Path) -> None:
    """Every tensor's data aligned, inside the file and right after the previous one's (GGUFPathError
    otherwise)."""
    align, size = h.alignment, h.data_size
    spans = []
    for t in h.tensors:
        offset, nbytes = t.offset, t.nbytes
        if align <= 0 or offset % align:
            raise GGUFPathError(f"{path}: tensor {t.name}: data offset {offset} is not a multiple of the "
                                f"alignment {align}: the file is damaged")
        if offset > size or nbytes > size - offset:
            raise GGUFPathError(f"{path}: tensor {t.name}: data at {offset}..{offset + nbytes} lies past the end of "
                                f"the data section ({size} bytes): the file is truncated or damaged")
        spans.append((offset, offset + nbytes, t.name))
    spans.sort()
    if spans and spans[0][0] != 0:
        raise GGUFPathError(f"{path}: tensor {spans[0][2]}: the first tensor's data starts at {spans[0][0]}, not at "
                            "the start of the data section: the file is damaged")
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise GGUFPathError(f"{path}: tensors {a} and {b} share data bytes (offset {start}): the file is "
                                "damaged")
        if start != -(-end // align) * align:
            raise GGUFPathError(f"{path}: tensor {b}: {start - end} bytes between its data and {a}'s, more than the "
                                f"alignment padding: a tensor's type or shape is damaged")
