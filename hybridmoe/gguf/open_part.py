"""Open one GGUF file with the `gguf` package and check where its tensors' data lie.

The package trusts the tensor infos: a data offset past the end of the file wraps around (numpy
uint64) to some other place in it, and two tensors may point at the same bytes, so a damaged file
can load "successfully" with weights read from the wrong place. As llama.cpp's loader does, every
tensor's data must start at a multiple of the file's alignment and lie inside the file, and the
tensors must follow one another with only the alignment padding between them (llama.cpp refuses
any other layout, so every file it serves passes): a tensor whose type or shape was damaged then
overlaps its neighbour or leaves a gap.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from hybridmoe.gguf.paths import GGUFPathError

if TYPE_CHECKING:
    from gguf import GGUFReader


def open_part(path: str | Path) -> GGUFReader:
    """The reader of the GGUF file at `path`; GGUFPathError (one line naming the file and, for a bad
    layout, the tensor) if the package cannot read it or a tensor's data is out of place."""
    from gguf import GGUFReader

    try:
        with warnings.catch_warnings():  # overflow warnings on wrapped offsets: reported below instead
            warnings.simplefilter("ignore", RuntimeWarning)
            r = GGUFReader(str(path), "r")
    except Exception as e:  # noqa: BLE001  (the gguf package raises several types)
        raise GGUFPathError(f"{path}: not a readable GGUF file ({e})") from None
    check_layout(r, path)
    return r


def check_layout(r: GGUFReader, path: str | Path) -> None:
    """Every tensor's data aligned, inside the file and right after the previous one's (GGUFPathError
    otherwise)."""
    align = int(r.alignment)
    size = len(r.data) - int(r.data_offset)  # bytes of the data section
    spans = []
    for t in r.tensors:
        offset = int(t.field.parts[-1][0])  # as written: relative to the data section
        nbytes = int(t.n_bytes)
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
