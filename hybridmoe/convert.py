"""`hybridmoe convert` / `python -m hybridmoe.convert`: a Hugging Face checkpoint's routed experts ->
the CPU expert weight directory that `--kt-weight-path` loads (format: weights/cpu_format.py).

Streamed: one MoE layer at a time, its experts read tensor by tensor with pread (no mmap, so the
resident memory is only the buffers filled) in chunks of experts; each chunk is packed and written
at its final offsets in the layer file by a writer thread, so RAM holds a few chunks (about 0.5 GB)
whatever the model's size; the finished file is read back from the page cache to hash it while the
next layer is packed.
Resumable: every layer file is written under a temporary name and renamed when complete, then
recorded (with its sha256) in progress.json; manifest.json comes last. `--resume` re-verifies the
recorded layers and converts the rest; the result is byte-identical to an uninterrupted run.

Legend: E experts, I expert intermediate size, H hidden size, c experts per chunk.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from hybridmoe.args import OneLineParser
from hybridmoe.cpu import pack as native_pack
from hybridmoe.cpu.quant import ACTIVATIONS, GROUP_SIZES, pack_layer
from hybridmoe.startup import report_failure
from hybridmoe.weights import cpu_format as cf
from hybridmoe.weights.dir_lock import DirLock
from hybridmoe.weights.fingerprint import expert_fingerprint
from hybridmoe.weights.loader import CheckpointError
from hybridmoe.weights.shards import DTYPES
from hybridmoe.weights.source_reader import INPUT_DTYPES, ConvertError, SourceReader

log = logging.getLogger("hybridmoe.convert")

INPUT_TYPES = [*sorted(INPUT_DTYPES), "gguf"]
QUANT_METHODS = {"int8": "AMXINT8", "moe_int8": "AMXINT8", "int4": "AMXINT4", "moe_int4": "AMXINT4", "bf16": "BF16"}
CHUNK_BYTES = 128 << 20  # float32 input of one chunk of experts
DELAY_ENV = "HYBRIDMOE_CONVERT_LAYER_DELAY_S"  # tests: pause after each layer (to kill mid-way)


def _size(n: int) -> str:
    """Bytes for a message: '0 B', '3.3 MB', '12.40 GB' (GB alone printed a small need as 0.00)."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n} B"


@dataclass
class ConvertOptions:
    input_path: str
    output: str
    quant_method: str
    input_type: str = "bf16"
    group_size: int = 128
    threads: int | None = None
    resume: bool = False
    progress: bool = True


class Converter:
    """Converts the MoE layers of one checkpoint into one output directory."""

    def __init__(self, opts: ConvertOptions) -> None:
        from hybridmoe import __version__
        from hybridmoe.model_check import check_expert_tensors, expert_shapes, load_checked_config

        self.opts = opts
        self.source_path = str(Path(opts.input_path).resolve())  # as given (a GGUF: not its view directory)
        if opts.quant_method not in QUANT_METHODS:
            raise ConvertError(f"--quant-method {opts.quant_method!r}: expected one of {sorted(QUANT_METHODS)}")
        if opts.input_type not in INPUT_TYPES:
            raise ConvertError(f"--input-type {opts.input_type!r}: expected one of {INPUT_TYPES}")
        self.method = QUANT_METHODS[opts.quant_method]
        if self.method == "AMXINT4" and opts.group_size not in GROUP_SIZES:
            raise ConvertError(f"--group-size {opts.group_size}: int4 groups must be one of {GROUP_SIZES}")
        gguf = opts.input_type == "gguf"
        if gguf:  # the GGUF seen as a model directory (config.json from its metadata: gguf/view.py)
            from hybridmoe.gguf.view import ERRORS, gguf_view

            try:
                self.opts = opts = dataclasses.replace(opts, input_path=str(gguf_view(opts.input_path)))
            except ERRORS as e:
                raise ConvertError(f"--input-path: {e}") from None
        config, self.spec = load_checked_config(opts.input_path, flag="--input-path")
        if not self.spec.moe_layers:
            raise ConvertError(f"{opts.input_path}/config.json: the model has no MoE layers; nothing to convert")
        act = {"swish": "silu"}.get(getattr(config, "hidden_act", "silu"), getattr(config, "hidden_act", "silu"))
        if act not in ACTIVATIONS:
            raise ConvertError(f"{opts.input_path}/config.json: hidden_act {act!r} is not supported by the CPU "
                               f"kernels ({sorted(ACTIVATIONS)})")
        self.activation = act
        self.e, self.i, self.h = self.spec.num_experts, self.spec.moe_intermediate, config.hidden_size
        if gguf:  # names, shapes and block types of every expert tensor, checked on opening
            from hybridmoe.gguf.convert_source import GGUFSourceReader
            from hybridmoe.gguf.view import gguf_source

            self.reader = GGUFSourceReader(gguf_source(opts.input_path), config, self.spec)
        else:
            self.reader = SourceReader(opts.input_path, opts.input_type, config)
        # every expert tensor's presence, shape, dtype and the files' sizes, before anything is written
        tensors = {} if gguf else check_expert_tensors(opts.input_path, config, self.spec)
        for name in ([] if gguf else expert_shapes(config, self.spec)):
            problem = self.reader.dtype_problem(DTYPES[tensors[name].dtype])
            if problem is not None:
                raise ConvertError(f"{tensors[name].file.name}: tensor {name!r} {problem}")
        one = pack_layer(torch.zeros(1, 2 * self.i, self.h), torch.zeros(1, self.h, self.i), self.method,
                         opts.group_size, True, act)
        # name -> (dtype, shape) of each layer file's tensors, and its layer meta
        self.layout = {k: (t.dtype, (self.e, *t.shape[1:])) for k, t in one.tensors().items()}
        self.layer_meta = dict(one.meta(), num_experts=self.e)
        self.layer_out_bytes = self.e * sum(t.numel() * t.element_size() for t in one.tensors().values())
        canon = cf.canonical_config(opts.input_path)
        self.header = {
            "format": cf.FORMAT, "format_version": cf.FORMAT_VERSION, "converter": f"hybridmoe {__version__}",
            "method": self.method, "quant_method": opts.quant_method, "input_type": opts.input_type,
            "group_size": opts.group_size, "symmetric": True, "activation": act,
            "architecture": (config.architectures or ["?"])[0], "num_experts": self.e, "hidden": self.h,
            "inter": self.i, "hidden_pad": one.hidden_pad, "inter_pad": one.inter_pad,
            "moe_layers": list(self.spec.moe_layers), "checksum": cf.CHECKSUM,
            "source_config_sha256": cf.config_hash(canon), "source_config": canon,
            # checks the shards' headers (a truncated file is named here, before anything is written)
            "source_experts_fingerprint": expert_fingerprint(opts.input_path, self.spec, config),
        }
        self.chunk = max(1, min(self.e, CHUNK_BYTES // (3 * self.i * self.h * 4)))
        self.out = Path(opts.output)

    # ---- the output directory and what is already done ----
    def _prepare_output(self) -> dict[str, dict]:
        """Creates or checks the output directory; the verified finished layer files (name -> entry)."""
        out, opts = self.out, self.opts
        mpath, ppath = out / cf.MANIFEST, out / cf.PROGRESS
        state = mpath if mpath.is_file() else ppath if ppath.is_file() else None
        if state is None:
            ours = [p.name for p in out.glob("layer_*.safetensors*")]
            if ours:
                raise ConvertError(f"{out}: holds layer files ({ours[0]}, ...) but no {cf.MANIFEST} or {cf.PROGRESS}; "
                                   "remove them or choose another --output")
            self._check_space(len(self.spec.moe_layers))  # before anything is written
            cf.write_json_atomic(ppath, dict(self.header, files={}))
            return {}
        if not opts.resume:
            what = "a complete conversion" if state == mpath else "an unfinished conversion"
            hint = "check it with `hybridmoe convert --verify`" if state == mpath else "continue it with --resume"
            raise ConvertError(f"{out}: already holds {what}; {hint}, or choose another --output")
        prev = cf.read_state(state, f"its layer files cannot be verified without it: remove {out} and convert "
                                    "again (or choose another --output)")
        older = [k for k in self.header if k not in prev]
        if older:
            raise ConvertError(f"{state}: written by another hybridmoe version (no {', '.join(older)}); finish it "
                               f"with that version, or convert again into another --output")
        diff = [k for k in self.header if prev.get(k) != self.header[k]]
        if diff:
            raise ConvertError(f"{state}: the conversion there used other settings or another checkpoint (differs "
                               f"in {', '.join(diff)}); rerun with the same options or choose another --output")
        for tmp in out.glob("*.tmp"):  # left by the interrupted run
            try:
                tmp.unlink()
            except OSError as e:  # e.g. a directory of that name
                raise ConvertError(f"{tmp}: cannot be removed ({e.strerror}); remove it by hand, then rerun with "
                                   "--resume") from None
        done = {}
        for name, entry in prev["files"].items():
            path = out / name
            if path.is_file() and path.stat().st_size == entry["bytes"] and cf.file_sha256(path) == entry["sha256"]:
                done[name] = entry
            else:
                log.warning("%s: missing or corrupted; converting layer %d again", path, entry["layer"])
        if state == mpath and len(done) < len(prev["files"]):  # bad files: unfinished again
            cf.write_json_atomic(ppath, dict(self.header, files=done))
            mpath.unlink()
        self._check_space(len(self.spec.moe_layers) - len(done))
        return done

    def _check_space(self, todo: int) -> None:
        where = self.out
        while not where.exists() and where != where.parent:  # the disk it will be created on
            where = where.parent
        need = todo * self.layer_out_bytes
        free = shutil.disk_usage(where).free
        if need > free:
            raise ConvertError(f"{self.out}: {_size(free)} free on that disk, the remaining {todo} layer(s) "
                               f"need {_size(need)}; free space or choose another --output")

    # ---- packing one layer ----
    def _read_chunk(self, layer: int, e0: int, e1: int) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up = torch.empty(e1 - e0, 2 * self.i, self.h)  # [c, 2I, H] float32
        down = torch.empty(e1 - e0, self.h, self.i)  # [c, H, I]
        for j, e in enumerate(range(e0, e1)):
            g, u, d = self.spec.expert_tensor_names(layer, e)
            self.reader.read_into(g, gate_up[j, : self.i])
            self.reader.read_into(u, gate_up[j, self.i:])
            self.reader.read_into(d, down[j])
        return gate_up, down

    def convert_layer(self, layer: int, file: cf.LayerFileWriter, prefetch: ThreadPoolExecutor,
                      writer: ThreadPoolExecutor, bar: tqdm) -> None:
        """Packs layer `layer` chunk by chunk into `file`: chunk k+1 is read while chunk k is packed, and
        written while chunk k+2 is read; at most two chunks of input and two of output are alive."""
        wfut: Future | None = None
        fut = prefetch.submit(self._read_chunk, layer, 0, min(self.chunk, self.e))
        try:
            for e0 in range(0, self.e, self.chunk):
                e1 = min(e0 + self.chunk, self.e)
                gate_up, down = fut.result()
                if e1 < self.e:
                    fut = prefetch.submit(self._read_chunk, layer, e1, min(e1 + self.chunk, self.e))
                try:
                    part = native_pack.pack_layer(gate_up, down, self.method, self.opts.group_size, True,
                                                  self.activation, chunk=e1 - e0, pool=native_pack.load_pool()).tensors()
                except native_pack.NonFiniteWeights as bad:  # name the checkpoint tensor
                    names = dict(zip(("gate_proj", "up_proj", "down_proj"),
                                     self.spec.expert_tensor_names(layer, e0 + bad.expert), strict=True))
                    raise CheckpointError(f"tensor '{names[bad.proj]}': row {bad.row} holds NaN or infinite values: "
                                          "the checkpoint is damaged") from None
                del gate_up, down
                if wfut is not None:
                    wfut.result()
                wfut = writer.submit(self._write_part, file, e0, part)
                del part
                bar.update(self.expert_in_bytes * (e1 - e0))
            if wfut is not None:
                wfut.result()
        except BaseException:
            for f in (fut, wfut):  # nothing may touch the file after abort
                if f is not None and not f.cancel():
                    f.exception()
            file.abort()
            raise

    @staticmethod
    def _write_part(file: cf.LayerFileWriter, first: int, part: dict[str, torch.Tensor]) -> None:
        for name, rows in part.items():
            file.write(name, first, rows)

    # ---- the whole conversion ----
    def run(self) -> Path:
        """Converts every MoE layer not yet done, then writes the manifest; the output directory.
        The directory is locked meanwhile: a second writer is refused."""
        delay = layer_delay()  # (a bad value was found after the output directory had been written to)
        if not self.out.exists():
            self._check_space(len(self.spec.moe_layers))  # before anything is created
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConvertError(f"--output {self.out}: cannot be created: {e}") from e
        with DirLock(self.out, "hybridmoe convert"):
            return self._run(delay)

    def _run(self, delay: float) -> Path:
        done = self._prepare_output()
        names = {cf.layer_file_name(layer): layer for layer in self.spec.moe_layers}
        todo = [layer for name, layer in names.items() if name not in done]
        in_bytes = self.e * self.expert_in_bytes
        bar = tqdm(total=in_bytes * len(names), initial=in_bytes * (len(names) - len(todo)), unit="B",
                   unit_scale=True, unit_divisor=1000, desc=f"Converting to {self.method}", disable=not self.opts.progress,
                   dynamic_ncols=True)
        pending: tuple[str, int, Future] | None = None
        t0 = time.perf_counter()
        with ThreadPoolExecutor(1, "convert-read") as reader, ThreadPoolExecutor(1, "convert-write") as writer:
            try:
                for layer in todo:
                    name = cf.layer_file_name(layer)
                    meta = {"format": cf.FORMAT, "format_version": str(cf.FORMAT_VERSION), "layer": str(layer),
                            "meta": json.dumps(self.layer_meta, sort_keys=True)}
                    file = cf.LayerFileWriter(self.out / name, self.layout, meta)
                    self.convert_layer(layer, file, reader, writer, bar)
                    if pending is not None:  # the previous layer's file was finished meanwhile
                        self._record(done, *pending, bar, len(names))
                    pending = (name, layer, writer.submit(file.finish))  # hashed while the next layer is packed
                    if delay:
                        time.sleep(delay)
                if pending is not None:
                    self._record(done, *pending, bar, len(names))
                    pending = None
            except BaseException:  # keep a layer finished meanwhile for --resume
                if pending is not None and pending[0] not in done and not pending[2].cancel() \
                        and pending[2].exception() is None:
                    self._record(done, *pending, bar, len(names))
                raise
            finally:
                bar.close()
                self.reader.close()
        manifest = dict(self.header, source_path=self.source_path,
                        files=dict(sorted(done.items())))
        cf.write_json_atomic(self.out / cf.MANIFEST, manifest)
        (self.out / cf.PROGRESS).unlink(missing_ok=True)
        secs = time.perf_counter() - t0
        gb = in_bytes * len(todo) / 1e9
        log.info("converted %d layer(s), %.2f GB in %.1f s (%.2f s/GB) into %s", len(todo), gb, secs,
                 secs / gb if gb else 0.0, self.out)
        return self.out

    @property
    def expert_in_bytes(self) -> int:
        """Bytes of one expert in the checkpoint (nominal, for the progress bar and s/GB)."""
        return 3 * self.i * self.h * {"bf16": 2, "fp16": 2, "fp8": 1, "gguf": 1}[self.opts.input_type]

    def _record(self, done: dict, name: str, layer: int, fut: Future, bar: tqdm, total: int) -> None:
        """Waits for a layer file's writer, then records it (with its checksum) in progress.json."""
        nbytes, sha = fut.result()
        done[name] = {"layer": layer, "bytes": nbytes, "sha256": sha}
        cf.write_json_atomic(self.out / cf.PROGRESS, dict(self.header, files=dict(sorted(done.items()))))
        bar.set_postfix_str(f"layers {len(done)}/{total}")


def layer_delay() -> float:
    """$HYBRIDMOE_CONVERT_LAYER_DELAY_S: seconds in [0, 86400]; ConvertError naming the variable otherwise (it was
    a ValueError or OverflowError from time.sleep, naming nothing)."""
    text = os.environ.get(DELAY_ENV, "") or "0"
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value <= 86400):
        raise ConvertError(f"${DELAY_ENV}={text!r}: expected seconds in [0, 86400] (or leave it unset)")
    return value


def verify(path: str) -> int:
    """`hybridmoe convert --verify DIR`: re-hash every file; 0 when all match the manifest."""
    if not Path(path).is_dir():
        raise ConvertError(f"--verify {path}: no such directory")
    d = cf.CPUWeightDir(path)
    problems = d.verify()
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if problems:
        print(f"{path}: {len(problems)} of {len(d.by_layer)} layer file(s) failed verification", file=sys.stderr)
        return 1
    total = sum(v["bytes"] for v in d.manifest["files"].values())
    print(f"{path}: OK, {len(d.by_layer)} layer files, {d.method}, {total / 1e9:.3f} GB verified")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="hybridmoe convert", description="Hugging Face checkpoint -> CPU expert "
                                "weights for --kt-weight-path (layer by layer, resumable, checksummed).")
    p.add_argument("--input-path", help="Hugging Face model directory (config.json + *.safetensors)")
    p.add_argument("--input-type", default="bf16", choices=INPUT_TYPES,
                   help="dtype of the routed experts in the checkpoint (fp8: block-scaled, weight_scale_inv; "
                        "gguf: --input-path is a GGUF file or directory of split files, dequantized block by block)")
    p.add_argument("--output", help="output directory (created; holds only the CPU expert weights)")
    p.add_argument("--quant-method", choices=sorted(QUANT_METHODS),
                   help="int8/moe_int8 -> --kt-method AMXINT8, int4/moe_int4 -> AMXINT4, bf16 -> BF16")
    p.add_argument("--group-size", type=int, default=128, help=f"int4 group size, one of {GROUP_SIZES}")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted conversion in --output")
    p.add_argument("--verify", metavar="DIR", help="verify a converted directory's checksums and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="debug: a failure also prints its traceback")
    return p


def _warn_tokenizer(input_path: str) -> None:
    """convert does not read the tokenizer, but a broken one would fail the server later: say so now."""
    from hybridmoe.model_check import check_tokenizer

    if Path(input_path).is_dir() and (Path(input_path) / "config.json").is_file():
        try:
            check_tokenizer(input_path)
        except CheckpointError as e:
            log.warning("%s (converting anyway: the experts do not need it, but serving this checkpoint will "
                        "fail until it is fixed)", e)


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    ns = p.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        # Path("") is the current directory: an empty --output converted into it, an empty --verify was ignored
        empty = [f for f, v in (("--input-path", ns.input_path), ("--output", ns.output), ("--verify", ns.verify))
                 if v == ""]
        if empty:
            p.error(f"{empty[0]}: got '', expected a path")
        if ns.verify:
            return verify(ns.verify)
        missing = [f for f, v in (("--input-path", ns.input_path), ("--output", ns.output),
                                  ("--quant-method", ns.quant_method)) if v is None]
        if missing:
            p.error(f"the following arguments are required: {', '.join(missing)}")
        if ns.threads is not None:
            if ns.threads < 1:
                p.error(f"--threads: got {ns.threads}, expected a positive integer")
            cores = len(os.sched_getaffinity(0))
            if ns.threads > cores:
                log.warning("--threads %d is above the %d CPU core(s) this process may use; using %d", ns.threads,
                            cores, cores)
                ns.threads = cores
            torch.set_num_threads(ns.threads)
        _warn_tokenizer(ns.input_path)
        opts = ConvertOptions(ns.input_path, ns.output, ns.quant_method, ns.input_type, ns.group_size, ns.threads,
                              ns.resume, not ns.no_progress)
        out = Converter(opts).run()
    except KeyboardInterrupt:
        print("hybridmoe convert: interrupted; continue with the same command plus --resume", file=sys.stderr)
        return 130
    except Exception as e:  # a bad checkpoint, option or directory: one line (traceback with --log-level debug)
        return report_failure("hybridmoe convert", e, ns.log_level == "debug")
    print(f"{out}: done; serve with --kt-weight-path {out} --kt-method {QUANT_METHODS[ns.quant_method]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
