"""The CPU expert weight directory written by `hybridmoe convert` and read with `--kt-weight-path`.

Layout of a directory:
  manifest.json            written last: format version, method, group size, shapes, the source
                           config's hash, and one sha256 per layer file
  layer_NNNN.safetensors   one MoE layer's PackedLayer tensors (w13.data, w13.scale, ...; see
                           cpu/quant.py), exactly the bytes the CPU kernels read; the header is padded
                           so every tensor starts 64-byte aligned; __metadata__ holds the layer's meta
  progress.json            only while a conversion is unfinished (what `--resume` continues from)

Loading a layer is one sequential read into one buffer, hashed on the way, and tensor views into
that buffer: no repacking, no second copy. The files are standard safetensors (safe_open reads them).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import stat
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from hybridmoe.cpu import hugepages
from hybridmoe.cpu.quant import ACTIVATIONS, GROUP_SIZES, METHODS, PackedLayer, pack_layer, pad_sizes
from hybridmoe.weights.loader import CheckpointError
from hybridmoe.weights.shards import DTYPES, read_header  # noqa: F401 (re-exported for convert)

log = logging.getLogger(__name__)
FORMAT = "hybridmoe-cpu-experts"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PROGRESS = "progress.json"
CHECKSUM = "sha256"
ALIGN = 64
_BLOCK = 64 << 20  # bytes per read / hash step
# manifest.json / progress.json are kilobytes (one entry per layer); a huge (or sparse) one was read whole
_MAX_STATE_BYTES = 16 << 20
# a layer file's header (its tensor table and layer meta) is under a kilobyte; the bytes a manifest may
# give a layer file beyond its tensors' (a larger number was allocated before the checksum could refuse it)
_MAX_LAYER_HEADER = 1 << 20
_REDO = "rerun the same `hybridmoe convert` command with --resume: it re-verifies every file and redoes the bad ones"
# for a file that passes its checksum yet is not what convert writes (--resume would keep it)
_AGAIN = "convert the checkpoint again into a new directory (`hybridmoe convert --output NEW ...`)"
# keys of config.json that do not change the weights (dtype, storage quantization, tool version)
_VOLATILE_KEYS = ("quantization_config", "transformers_version", "torch_dtype", "dtype", "_name_or_path")

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class CPUWeightsError(CheckpointError):
    """A CPU weight directory that is incomplete, corrupted or does not match the model."""


def layer_file_name(layer: int) -> str:
    return f"layer_{layer:04d}.safetensors"


# ---- the source config's identity -----------------------------------------------------------
def canonical_config(model_path: str | Path) -> dict:
    """config.json without the keys that do not change the weights (so a bf16 copy of an fp8
    checkpoint has the same identity)."""
    path = Path(model_path) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read: {e}") from e
    return {k: v for k, v in sorted(cfg.items()) if k not in _VOLATILE_KEYS}


def config_hash(canonical: dict) -> str:
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ---- safetensors files, written and read without extra copies --------------------------------
def _raw_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _header(layout: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> tuple[bytes, dict]:
    """The safetensors header (padded so the data starts 64-byte aligned) and each tensor's file offset."""
    header: dict = {"__metadata__": metadata}
    rel, off = {}, 0
    for name, (dtype, shape) in layout.items():
        n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        rel[name], off = off, off + n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)
    head = struct.pack("<Q", len(raw)) + raw
    return head, {name: len(head) + o for name, o in rel.items()} | {"": len(head) + off}


class LayerFileWriter:
    """One safetensors file written piece by piece at the final offsets (so no whole layer is ever held
    in memory) under `path.tmp`; `finish` hashes it, fsyncs and renames it to `path`."""

    def __init__(self, path: Path, layout: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str]) -> None:
        self.path, self.tmp = path, path.with_name(path.name + ".tmp")
        head, self.offsets = _header(layout, metadata)
        self.size = self.offsets.pop("")
        self.row_bytes = {name: math.prod(shape[1:]) * torch.empty(0, dtype=dtype).element_size()
                          for name, (dtype, shape) in layout.items()}
        self.fd = -1
        try:
            self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.posix_fallocate(self.fd, 0, self.size)  # a full disk fails here, before any work
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(self.fd, self.size)
            self._pwrite(memoryview(head), 0)
        except OSError as e:
            self._fail(e)

    def _pwrite(self, data: memoryview, off: int) -> None:
        while len(data):
            n = os.pwrite(self.fd, data, off)
            data, off = data[n:], off + n

    def _fail(self, e: OSError) -> None:
        self.abort()
        if e.errno == errno.ENOSPC:
            raise CPUWeightsError(f"{self.path}: disk full while writing it ({self.size} bytes needed); free space "
                                  "and rerun with --resume") from e
        raise CPUWeightsError(f"{self.path}: cannot be written: {e}") from e

    def write(self, name: str, first: int, rows: torch.Tensor) -> None:
        """Rows first.. of tensor `name` (along dim 0)."""
        try:
            self._pwrite(_raw_bytes(rows), self.offsets[name] + first * self.row_bytes[name])
        except OSError as e:
            self._fail(e)

    def finish(self) -> tuple[int, str]:
        """fsync, hash (reading the file back from the page cache), rename; (bytes, sha256 hex)."""
        try:
            os.fsync(self.fd)
            h, buf = hashlib.sha256(), bytearray(min(_BLOCK, self.size))
            view = memoryview(buf)
            for off in range(0, self.size, _BLOCK):
                want = min(_BLOCK, self.size - off)
                if os.preadv(self.fd, [view[:want]], off) != want:
                    raise OSError(errno.EIO, f"short read at byte {off}")
                h.update(view[:want])
            os.close(self.fd)
            self.fd = -1
            os.replace(self.tmp, self.path)
        except OSError as e:
            self._fail(e)
        return self.size, h.hexdigest()

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.tmp.unlink(missing_ok=True)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[int, str]:
    """Writes `path` atomically (path.tmp, fsync, rename); returns (bytes, sha256 hex)."""
    w = LayerFileWriter(path, {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}, metadata)
    for name, t in tensors.items():
        w.write(name, 0, t)
    return w.finish()


def read_verified(path: Path, size: int, sha256: str) -> tuple[torch.Tensor, dict, int]:
    """One sequential read of `path` into a buffer, checked against its size and sha256;
    returns (uint8 buffer, header, data offset)."""
    try:
        actual = path.stat().st_size
        if actual != size:
            raise CPUWeightsError(f"{path}: {actual} bytes, the manifest says {size}: the file is truncated or "
                                  f"was replaced; {_REDO}")
        buf = hugepages.empty(size, torch.uint8)  # the layer's tensors are views of it: streamed every token
        view = memoryview(buf.numpy())
        h = hashlib.sha256()
        hashed: Future | None = None
        with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(1, "cpu-weights-hash") as hasher:
            for i in range(0, size, _BLOCK):  # block k is hashed while block k+1 is read
                got = f.readinto(view[i:i + _BLOCK])
                if got != min(_BLOCK, size - i):
                    raise CPUWeightsError(f"{path}: short read at byte {i}")
                if hashed is not None:
                    hashed.result()
                hashed = hasher.submit(h.update, view[i:i + got])
            if hashed is not None:
                hashed.result()
    except OSError as e:
        raise CPUWeightsError(f"{path}: cannot be read: {e}") from e
    if h.hexdigest() != sha256:
        raise CPUWeightsError(f"{path}: checksum mismatch (sha256 {h.hexdigest()[:16]}..., manifest "
                              f"{sha256[:16]}...): the file is corrupted; {_REDO}")
    return buf, *_layer_header(path, view, size)


def _layer_header(path: Path, view: memoryview, size: int) -> tuple[dict, int]:
    """(header, data offset) of a layer file read into `view` ({size} bytes), checked to be a safetensors
    header (a file that passes its checksum may still have been written by something else than convert)."""
    (n,) = struct.unpack("<Q", bytes(view[:8])) if size >= 8 else (-1,)
    if not 0 < n <= min(size - 8, _MAX_LAYER_HEADER):
        raise CPUWeightsError(f"{path}: not a safetensors file (header length {n} for a {size}-byte file); {_AGAIN}")
    try:
        header = json.loads(bytes(view[8:8 + n]))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise CPUWeightsError(f"{path}: not a safetensors file (its header is not valid JSON: {e}); {_AGAIN}") from None
    if not isinstance(header, dict):
        raise CPUWeightsError(f"{path}: not a safetensors file (its header is a JSON {type(header).__name__}); {_AGAIN}")
    for name, info in header.items():
        if name == "__metadata__":
            continue
        ok = isinstance(info, dict) and info.get("dtype") in DTYPES and isinstance(info.get("shape"), list) \
            and all(isinstance(d, int) and d >= 0 for d in info["shape"]) \
            and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2 \
            and all(isinstance(o, int) for o in info["data_offsets"])
        if ok:
            b, e = info["data_offsets"]
            nbytes = math.prod(info["shape"]) * torch.empty(0, dtype=DTYPES[info["dtype"]]).element_size()
            ok = 0 <= b <= e <= size - 8 - n and e - b == nbytes
        if not ok:
            raise CPUWeightsError(f"{path}: tensor {name!r}: its header entry {str(info)[:120]} is not a dtype, "
                                  f"shape and data_offsets that fit the file; {_AGAIN}")
    return header, 8 + n


def tensor_views(buf: torch.Tensor, header: dict, data_start: int) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file read into `buf`, as views (a copy only where misaligned)."""
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES[info["dtype"]]
        b, e = info["data_offsets"]
        raw = buf[data_start + b:data_start + e]
        if (data_start + b) % torch.empty(0, dtype=dtype).element_size():
            raw = raw.clone()
        out[name] = raw.view(dtype).reshape(info["shape"])
    return out


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_BLOCK):
            h.update(chunk)
    return h.hexdigest()


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CPUWeightsError(f"{path}: cannot be written: {e}") from e


# ---- manifest.json and progress.json ---------------------------------------------------------
_STATE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "format": str, "format_version": int, "method": str, "quant_method": str, "num_experts": int, "hidden": int,
    "inter": int, "hidden_pad": int, "inter_pad": int, "group_size": int, "symmetric": bool, "activation": str,
    "moe_layers": list, "source_config_sha256": str, "files": dict,
}


def _state_problem(m: object) -> str | None:
    """What is wrong with a manifest/progress object (None: well formed)."""
    if not isinstance(m, dict):
        return f"a JSON {type(m).__name__}, expected an object"
    if m.get("format") != FORMAT:
        return f"format {m.get('format')!r}, expected {FORMAT!r}"
    for key, typ in _STATE_FIELDS.items():
        if not isinstance(m.get(key), typ) or (typ is int and isinstance(m.get(key), bool)):
            return f"field {key!r} is {'missing' if key not in m else repr(m[key])[:60]}"
    if not all(isinstance(v, int) for v in m["moe_layers"]):
        return "field 'moe_layers' is not a list of layer numbers"
    if m["method"] not in METHODS:  # what convert writes (quant.METHODS); anything else names no kernel
        return f"field 'method' is {m['method']!r}, expected one of {sorted(METHODS)}"
    if m["activation"] not in ACTIVATIONS:
        return f"field 'activation' is {m['activation']!r}, expected one of {sorted(ACTIVATIONS)}"
    for name, v in m["files"].items():
        if not (isinstance(v, dict) and isinstance(v.get("layer"), int) and isinstance(v.get("bytes"), int)
                and isinstance(v.get("sha256"), str) and len(v["sha256"]) == 64):
            return f"the entry of {name!r} under 'files' is not {{layer, bytes, sha256}}"
        if name != layer_file_name(v["layer"]):
            return f"the entry {name!r} under 'files' names layer {v['layer']}"
    return None


def read_state(path: Path, what_to_do: str) -> dict:
    """A converted directory's manifest.json or progress.json, checked for the fields this version
    uses; a damaged one is an error saying so and `what_to_do`."""
    try:
        size = path.stat().st_size
        m = json.loads(path.read_text()) if size <= _MAX_STATE_BYTES else None
    except OSError as e:
        raise CPUWeightsError(f"{path}: cannot be read: {e}") from e
    except ValueError as e:
        raise CPUWeightsError(f"{path}: damaged (not valid JSON: {e}); {what_to_do}") from e
    except RecursionError:  # json's parser recurses per nesting level: [[[...]]] 100000 deep
        raise CPUWeightsError(f"{path}: damaged (not valid JSON: nested too deeply); {what_to_do}") from None
    if size > _MAX_STATE_BYTES:
        raise CPUWeightsError(f"{path}: damaged ({size} bytes; a {path.name} is at most {_MAX_STATE_BYTES >> 20} MiB); "
                              f"{what_to_do}")
    if isinstance(m, dict) and m.get("format") == FORMAT and m.get("format_version") != FORMAT_VERSION:
        raise CPUWeightsError(f"{path}: format version {m.get('format_version')}; this hybridmoe reads "
                              f"version {FORMAT_VERSION}: reconvert with this version")
    problem = _state_problem(m)
    if problem is not None:
        raise CPUWeightsError(f"{path}: damaged ({problem}); {what_to_do}")
    return m


# ---- the directory ---------------------------------------------------------------------------
class CPUWeightDir:
    """A complete converted directory (its manifest read and checked)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        mpath = self.path / MANIFEST
        if not self.path.is_dir():
            raise CPUWeightsError(f"--kt-weight-path {self.path}: no such directory")
        if not mpath.is_file():
            if (self.path / PROGRESS).is_file():
                raise CPUWeightsError(f"{self.path}: an unfinished conversion (no {MANIFEST}, {PROGRESS} present); "
                                      "finish it with `hybridmoe convert ... --resume`")
            raise CPUWeightsError(f"{self.path}: no {MANIFEST}; not a directory written by `hybridmoe convert`")
        m = read_state(mpath, f"convert the checkpoint again into a new directory (`hybridmoe convert "
                              f"--output NEW ...`), or remove {self.path} and convert into it")
        self.manifest = m
        self.by_layer = {int(v["layer"]): (self.path / name, v) for name, v in m["files"].items()}
        self._layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None

    @property
    def method(self) -> str:
        return self.manifest["method"]

    def check_model(self, config, model_path: str, kt_method: str | None, spec=None) -> None:
        """The directory must have been converted from `model_path`'s architecture and shapes, with
        `kt_method`; raises CPUWeightsError naming the mismatch."""
        from hybridmoe.models.registry import arch_spec

        m, where = self.manifest, self.path / MANIFEST
        if kt_method is not None and kt_method.upper() != m["method"]:
            raise CPUWeightsError(f"{where}: the weights are {m['method']} (converted with --quant-method "
                                  f"{m['quant_method']}) but --kt-method is {kt_method.upper()}; pass "
                                  f"--kt-method {m['method']}")
        spec = spec or arch_spec(config, f"{model_path}/config.json")
        want = {"num_experts": spec.num_experts, "hidden": config.hidden_size, "inter": spec.moe_intermediate,
                "moe_layers": list(spec.moe_layers)}
        bad = [f"{k} {m[k]} (model {v})" for k, v in want.items() if m[k] != v]
        if bad:
            raise CPUWeightsError(f"{where}: converted for another model: {', '.join(bad)} ({model_path})")
        canon = canonical_config(model_path)
        if config_hash(canon) != m["source_config_sha256"]:
            src = m.get("source_config", {})
            diff = sorted(k for k in set(src) | set(canon) if src.get(k) != canon.get(k))
            raise CPUWeightsError(f"{where}: converted from a different checkpoint than {model_path} (config.json "
                                  f"differs in {', '.join(diff) or 'content'}); reconvert from --model's checkpoint")
        self._check_layout()
        self._check_experts(config, model_path, spec)
        missing = [layer for layer in spec.moe_layers if layer not in self.by_layer]
        if missing:
            raise CPUWeightsError(f"{where}: no file for MoE layer(s) {missing}")
        data = sum(math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
                   for dtype, shape in self.expected_layout().values())  # tensor bytes of one layer file
        for layer in spec.moe_layers:
            self._check_file(layer, data)

    def _check_layout(self) -> None:
        """The group size and paddings must be the ones `convert` derives from the sizes: the kernels walk
        the packed tensors by the paddings, and the layer files' shapes are checked against the sizes alone."""
        m, where = self.manifest, self.path / MANIFEST
        gs = m["group_size"]
        if gs < 1 or (m["method"] == "AMXINT4" and gs not in GROUP_SIZES):
            raise CPUWeightsError(f"{where}: damaged (field 'group_size' is {gs}, expected "
                                  f"{f'one of {GROUP_SIZES}' if m['method'] == 'AMXINT4' else 'a positive integer'})")
        pads = pad_sizes(m["hidden"], m["inter"], m["method"], gs)
        if (m["hidden_pad"], m["inter_pad"]) != pads:
            raise CPUWeightsError(f"{where}: damaged (fields 'hidden_pad', 'inter_pad' are {m['hidden_pad']}, "
                                  f"{m['inter_pad']}; hidden {m['hidden']} and inter {m['inter']} with {m['method']} "
                                  f"give {pads[0]}, {pads[1]})")

    def _check_file(self, layer: int, data: int) -> None:
        """Layer `layer`'s file exists, is a regular file and has the size the manifest gives it, a size that
        fits its tensors (`data` bytes) plus a header (before the model loads; load_layer verifies the checksum)."""
        path, info = self.by_layer[layer]
        if not data < info["bytes"] <= data + _MAX_LAYER_HEADER:
            raise CPUWeightsError(f"{self.path / MANIFEST}: damaged (the entry of {path.name} under 'files' gives "
                                  f"{info['bytes']} bytes; its tensors take {data} bytes plus a header)")
        try:
            st = path.stat()
        except OSError as e:
            raise CPUWeightsError(f"{path}: cannot be read: {e}; {_REDO}") from None
        if not stat.S_ISREG(st.st_mode):
            raise CPUWeightsError(f"{path}: not a regular file (expected the layer file written by `hybridmoe "
                                  f"convert`); {_REDO}")
        if st.st_size != info["bytes"]:
            raise CPUWeightsError(f"{path}: {st.st_size} bytes, the manifest says {info['bytes']}: the file is "
                                  f"truncated or was replaced; {_REDO}")

    def _check_experts(self, config, model_path: str, spec) -> None:
        """The routed experts' fingerprint (weights/fingerprint.py) must be the one recorded at conversion."""
        from hybridmoe.weights import fingerprint

        m = self.manifest
        recorded = m.get("source_experts_fingerprint")
        if recorded is None:  # converted before the fingerprint existed: loads, with a word
            log.warning("%s: converted by an older hybridmoe, without an expert fingerprint: only config.json could "
                        "be compared with %s; convert again to bind the weights to their checkpoint", self.path,
                        model_path)
            return
        scheme = str(recorded).split(":", 1)[0]
        if scheme not in fingerprint.SCHEMES:
            raise CPUWeightsError(f"{self.path / MANIFEST}: expert fingerprint scheme {scheme!r} is unknown to this "
                                  f"hybridmoe (it computes {fingerprint.SCHEME!r}); convert again with this version")
        actual = fingerprint.expert_fingerprint(model_path, spec, config)
        if actual != recorded:
            src = m.get("source_path") or "another checkpoint"
            raise CPUWeightsError(
                f"--kt-weight-path {self.path} holds experts converted from {src}, not from --model {model_path}: "
                f"config.json matches but the expert weights differ (fingerprint {recorded.split(':')[-1][:12]} "
                f"recorded, {actual.split(':')[-1][:12]} in {model_path}); convert {model_path} with `hybridmoe "
                "convert` and pass that directory")

    def expected_layout(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Name -> (dtype, shape) of every layer file's tensors (from packing one zero expert)."""
        if self._layout is None:
            m = self.manifest
            h, i = m["hidden"], m["inter"]
            one = pack_layer(torch.zeros(1, 2 * i, h), torch.zeros(1, h, i), m["method"], m["group_size"],
                             m["symmetric"], m["activation"])
            self._layout = {k: (t.dtype, (m["num_experts"], *t.shape[1:])) for k, t in one.tensors().items()}
        return self._layout

    def load_layer(self, layer: int, experts: torch.Tensor | None = None) -> PackedLayer:
        """Layer `layer`'s packed experts, read once and verified against the manifest; with `experts`
        (ids [Ec]), only those, renumbered 0..Ec-1 in that order (the CPU-resident ones of a hybrid split)."""
        if layer not in self.by_layer:
            raise CPUWeightsError(f"{self.path / MANIFEST}: no file for MoE layer {layer}")
        path, info = self.by_layer[layer]
        buf, header, start = read_verified(path, info["bytes"], info["sha256"])
        tensors = tensor_views(buf, header, start)
        meta = header.get("__metadata__")
        try:
            meta = json.loads(meta.get("meta", "{}")) if isinstance(meta, dict) else {}
        except (TypeError, ValueError, RecursionError):
            meta = None
        if not isinstance(meta, dict):
            raise CPUWeightsError(f"{path}: its layer meta (__metadata__.meta) is not a JSON object; {_AGAIN}")
        want = {k: self.manifest[k] for k in ("method", "num_experts", "hidden", "inter", "hidden_pad", "inter_pad",
                                              "group_size", "symmetric", "activation")}
        layout = {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}
        expected = self.expected_layout()
        if meta != want:
            diff = sorted(k for k in set(want) | set(meta) if meta.get(k) != want.get(k))
            raise CPUWeightsError(f"{path}: its layer meta does not match {MANIFEST} (differs in {', '.join(diff)}); "
                                  f"{_AGAIN}")
        if layout != expected:
            name = sorted(k for k in set(layout) | set(expected) if layout.get(k) != expected.get(k))[0]
            got = "missing" if name not in layout else f"{layout[name][0]} {list(layout[name][1])}"
            exp = "no such tensor" if name not in expected else f"{expected[name][0]} {list(expected[name][1])}"
            raise CPUWeightsError(f"{path}: tensor {name!r} is {got}, {MANIFEST} implies {exp}; {_AGAIN}")
        for name, t in tensors.items():  # the scales: a NaN or Inf turns every output of its expert into NaN
            if t.is_floating_point() and not name.endswith(".data") and not bool(torch.isfinite(t).all()):
                raise CPUWeightsError(f"{path}: tensor {name!r} holds NaN or infinite values (the converter never "
                                      f"writes them); {_AGAIN}")
        if experts is not None:
            ids = experts.to("cpu", torch.long)
            tensors = {k: torch.index_select(t, 0, ids, out=hugepages.empty((len(ids), *t.shape[1:]), t.dtype))
                       for k, t in tensors.items()}
            meta = dict(meta, num_experts=len(ids))
        return PackedLayer.from_tensors(meta, tensors)

    def verify(self) -> list[str]:
        """Problems found re-hashing every file (empty = all good)."""
        problems = []
        for _layer, (path, info) in sorted(self.by_layer.items()):
            try:
                if not path.exists():
                    problems.append(f"{path}: missing")
                elif not path.is_file():  # a directory or a FIFO (never opened: a FIFO's read would block)
                    problems.append(f"{path}: not a regular file")
                elif path.stat().st_size != info["bytes"]:
                    problems.append(f"{path}: {path.stat().st_size} bytes, the manifest says {info['bytes']}")
                elif file_sha256(path) != info["sha256"]:
                    problems.append(f"{path}: checksum mismatch: the file is corrupted")
            except OSError as e:  # unreadable (permissions, I/O error): that file's problem, the others still checked
                problems.append(f"{path}: cannot be read: {e.strerror or e}")
        return problems


def open_cpu_weights(path: str, config, model_path: str, kt_method: str | None, spec=None) -> CPUWeightDir:
    """Open `--kt-weight-path` and check it against `--model` (its ArchSpec `spec` when known) and
    `--kt-method`."""
    d = CPUWeightDir(path)
    d.check_model(config, model_path, kt_method, spec=spec)
    return d
