"""The structure of a GGUF file's header, checked before the `gguf` package reads it.

The package's reader trusts every length and count it reads: an array count of 2**62 over a scalar
type never advances past the end of the file (a hang that fills memory), a key length of 2**62 copies
the rest of the file into memory, a byte-swapped (big-endian) file is read with its tensors'
bytes in the wrong order, and a file cut short fails with numpy's words (`index 0 is out of bounds`)
naming neither key nor tensor. This walk follows llama.cpp's reader (gguf.cpp): the magic, version 2
or 3 in this host's byte order, every length and count within the bytes left, known type codes, no
nested arrays, unique keys and tensor names, at most 4 dimensions whose product fits int64 and whose
rows are whole blocks of the tensor's type. Every error is one line naming the file and the key,
tensor or byte where the walk stopped.

    h = read_header("model.gguf")   # GGUFPathError if damaged
    h.tensors[0].name, h.tensors[0].offset, h.tensors[0].nbytes, h.alignment, h.data_size
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from hybridmoe.gguf.paths import GGUFPathError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # what the gguf package reads (version 1 had 32-bit lengths)
FIXED = 24  # magic, version, tensor count, metadata count
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 65536  # key and tensor name bytes: far above any real name, keeps a damaged length from copying gigabytes
INT64_MAX = 2**63 - 1
DEFAULT_ALIGNMENT = 32
# GGUFValueType code -> (name, bytes) of the fixed-size types; 8 STRING and 9 ARRAY are walked apart
SCALARS = {0: ("UINT8", 1), 1: ("INT8", 1), 2: ("UINT16", 2), 3: ("INT16", 2), 4: ("UINT32", 4), 5: ("INT32", 4),
           6: ("FLOAT32", 4), 7: ("BOOL", 1), 10: ("UINT64", 8), 11: ("INT64", 8), 12: ("FLOAT64", 8)}
STRING, ARRAY, UINT32 = 8, 9, 4


@dataclass(frozen=True)
class TensorSpan:
    name: str
    offset: int  # as written: relative to the start of the data section
    nbytes: int


@dataclass(frozen=True)
class Header:
    alignment: int
    data_offset: int  # where the data section starts (the header's end, aligned)
    data_size: int  # bytes from there to the end of the file
    tensors: list[TensorSpan]


class _Walk:
    """A cursor over the mapped file that refuses to read past its end; `where` names what is being
    read, for the error."""

    def __init__(self, buf: mmap.mmap, path: str | Path) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)
        self.where = "the file header"

    def fail(self, problem: str) -> GGUFPathError:
        return unreadable(self.path, f"{self.where}: {problem}: the file is truncated or damaged")

    def take(self, n: int, what: str) -> int:
        """Skip n bytes of `what`; the offset they start at."""
        if n > self.size - self.pos:
            raise self.fail(f"{what} at byte {self.pos} needs {n} bytes, the file ends {self.size - self.pos} "
                            "bytes later")
        at = self.pos
        self.pos += n
        return at

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8, what))[0]

    def name(self, what: str) -> str:
        """A key or tensor name: length, then UTF-8 bytes."""
        n = self.u64(f"the length of {what}")
        if n > MAX_NAME:
            raise self.fail(f"{what} at byte {self.pos - 8} is {n} bytes long, more than any name ({MAX_NAME})")
        at = self.take(n, what)
        try:
            return self.buf[at:at + n].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at byte {at} is not UTF-8 text") from None

    def value(self, code: int, what: str) -> None:
        """Skip one metadata value of type `code` (arrays: of scalars or strings, not of arrays)."""
        if code in SCALARS:
            self.take(SCALARS[code][1], what)
        elif code == STRING:
            self.take(self.u64(f"the length of {what}"), what)
        elif code == ARRAY:
            self.array(what)
        else:
            raise self.fail(f"{what} has type code {code}, which is no GGUF value type")

    def array(self, what: str) -> None:
        item = self.u32(f"the item type of {what}")
        count = self.u64(f"the length of {what}")
        if item in SCALARS:
            type_name, size = SCALARS[item]
            if count * size > self.size - self.pos:
                raise self.fail(f"{what}: {count} {type_name} values need {count * size} bytes, the file ends "
                                f"{self.size - self.pos} bytes later")
            self.pos += count * size
        elif item == STRING:
            if count * 8 > self.size - self.pos:  # each string is at least its 8-byte length
                raise self.fail(f"{what}: {count} strings need at least {count * 8} bytes, the file ends "
                                f"{self.size - self.pos} bytes later")
            for i in range(count):
                self.take(self.u64(f"the length of {what}[{i}]"), f"{what}[{i}]")
        elif item == ARRAY:  # llama.cpp refuses nested arrays, so no file it serves has one
            raise self.fail(f"{what} is an array of arrays, which GGUF readers do not accept")
        else:
            raise self.fail(f"{what} has item type code {item}, which is no GGUF value type")


def unreadable(path: str | Path, what: str) -> GGUFPathError:
    """The error of a file whose header the walk refuses (the words open_part used before it)."""
    return GGUFPathError(f"{path}: not a readable GGUF file: {what}")


def read_header(path: str | Path) -> Header:
    """The checked header of the GGUF file at `path` (GGUFPathError, one line, if it is damaged)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < FIXED:
                raise unreadable(path, f"{size} bytes, less than the {FIXED} of a GGUF header: truncated, or not a "
                                       "GGUF file")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _walk(_Walk(buf, path))
    except OSError as e:
        raise unreadable(path, f"it cannot be read ({e.strerror or e})") from None


def _walk(w: _Walk) -> Header:
    _check_start(w)
    n_tensors, n_kv = w.u64("the tensor count"), w.u64("the metadata count")
    for count, what, least in ((n_tensors, "tensor", 24), (n_kv, "metadata", 13)):
        if count * least > w.size - w.pos:  # every entry takes at least `least` bytes
            raise w.fail(f"{count} {what} entries cannot fit in the {w.size - w.pos} bytes left")
    alignment = _metadata(w, n_kv)
    infos = [_tensor_info(w, i) for i in range(n_tensors)]
    w.where = "the tensor infos"
    names = set()
    for name, _, _ in infos:
        if name in names:
            raise w.fail(f"tensor {name} is listed twice")
        names.add(name)
    data_offset = -(-w.pos // alignment) * alignment
    if infos and data_offset > w.size:
        raise w.fail(f"the data section would start at byte {data_offset}, past the end of the file ({w.size} bytes)")
    return Header(alignment, data_offset, max(w.size - data_offset, 0),
                  [TensorSpan(name, offset, nbytes) for name, offset, nbytes in infos])


def _check_start(w: _Walk) -> None:
    magic = bytes(w.buf[0:4])
    if magic != MAGIC:
        raise unreadable(w.path, f"it starts with {magic!r}, not the GGUF magic {MAGIC!r}")
    w.pos = 4
    version = w.u32("the version")
    swapped = struct.unpack(">I", struct.pack("<I", version))[0]
    if swapped in VERSIONS:  # the file's numbers are big-endian: the package would read its weights' bytes swapped
        raise unreadable(w.path, f"a big-endian file (version {swapped}, byte-swapped); this host reads "
                                 "little-endian GGUF files: convert it with the gguf package's gguf_convert_endian.py")
    if version not in VERSIONS:
        raise unreadable(w.path, f"version {version}, versions {' and '.join(map(str, VERSIONS))} are read: the "
                                 "file is damaged or from an unsupported writer")


def _metadata(w: _Walk, count: int) -> int:
    """Walk `count` key-value pairs; the file's alignment (general.alignment, checked)."""
    keys: set[str] = set()
    alignment = DEFAULT_ALIGNMENT
    for i in range(count):
        w.where = f"metadata entry {i}"
        key = w.name("its key")
        w.where = f"metadata {key or repr(key)}"  # an empty key still shows
        if key in keys:
            raise w.fail("the key appears twice")
        keys.add(key)
        code = w.u32("its type code")
        at = w.pos
        w.value(code, "its value")
        if key == "general.alignment":
            alignment = _alignment(w, code, at)
    return alignment


def _alignment(w: _Walk, code: int, at: int) -> int:
    if code != UINT32:
        raise w.fail(f"type code {code}, expected {UINT32} (UINT32)")
    a = struct.unpack_from("<I", w.buf, at)[0]
    if a == 0 or a & (a - 1):
        raise w.fail(f"{a} is not a power of two")
    return a


def _tensor_info(w: _Walk, i: int) -> tuple[str, int, int]:
    """(name, data offset, data bytes) of tensor info `i`."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    w.where = f"tensor info {i}"
    name = w.name("the tensor name")
    w.where = f"tensor {name or repr(name)}"
    n_dims = w.u32("its dimension count")
    if n_dims > MAX_DIMS:
        raise w.fail(f"{n_dims} dimensions, GGUF allows at most {MAX_DIMS}")
    dims = [w.u64(f"dimension {d}") for d in range(n_dims)]
    n = 1
    for d in dims:
        n *= d
        if n > INT64_MAX:
            raise w.fail(f"shape {dims} has more than 2**63 elements")
    code = w.u32("its type")
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(code)]
    except (ValueError, KeyError):
        raise w.fail(f"type code {code}, which is no GGML tensor type") from None
    row = dims[0] if dims else 1
    if row % block:
        raise w.fail(f"rows of {row} values, not a whole number of {GGMLQuantizationType(code).name} blocks "
                     f"({block} values)")
    offset = w.u64("its data offset")
    return name, offset, n // block * type_size
