"""How the CPU engine's native library is built: one plain C++17 shared library, loaded with ctypes.

Each ISA's kernels live in their own translation unit compiled with that ISA's -m flags; the rest
is compiled for baseline x86-64 and picks a unit at run time (dispatch.cpp). A unit the compiler
cannot build (an old gcc without -mamx-*) is left out: its table is a weak symbol, and asking for
that ISA gives a clear error. Used by setup.py (pip install) and by `build_library` as a fallback
for a source checkout that was never installed. No torch import here, and no import of the
package: setup.py loads this file by path before hybridmoe is importable, so the one
development variable read here ($HYBRIDMOE_CXXFLAGS) comes from hybridmoe/envs.py loaded by path too.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
ENVS_FILE = Path(__file__).resolve().parents[1] / "envs.py"
LIB_BASENAME = "_hybridmoe_cpu"

BASE_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-Wall", "-Wno-unused-function", "-fno-strict-aliasing"]
AVX2 = ["-mavx2", "-mfma", "-mf16c"]
AVX512 = AVX2 + [
    "-Wno-uninitialized",
    "-Wno-maybe-uninitialized",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512vnni",
    "-mavx512bf16",
    "-mavx512vbmi",  # FP8 widening (vpermi2b); run only where the CPU has it (dispatch.cpp)
]
AMX = AVX512 + ["-mamx-tile", "-mamx-int8", "-mamx-bf16"]

# (source, extra flags, required): an optional unit that fails to compile is skipped.
UNITS: list[tuple[str, list[str], bool]] = [
    ("api.cpp", [], True),
    ("hostcall.cpp", [], True),
    ("trace.cpp", [], True),
    ("dispatch.cpp", [], True),
    ("threadpool.cpp", [], True),
    ("numa.cpp", [], True),
    ("stream.cpp", [], True),
    ("moe.cpp", [], True),
    ("moe_avx2.cpp", AVX2, True),
    ("quantize.cpp", AVX2 + ["-ffp-contract=off"], True),  # no fused multiply-add: bit-identical to torch
    ("moe_avx512.cpp", AVX512, False),
    ("moe_amx.cpp", AMX, False),
    ("moe_amx_emu.cpp", AVX512, False),  # moe_amx.cpp on a software model of the tiles (amx_tiles.h; tests)
    ("gguf_api.cpp", [], True),  # GGUF block layers (--kt-method LLAMAFILE)
    ("gguf_avx2.cpp", AVX2, True),
    ("gguf_avx512.cpp", AVX512, False),
    ("gguf_amx.cpp", AMX, False),  # gguf_avx512.cpp with the AMX tile path for large T
    ("gguf_amx_emu.cpp", AVX512, False),  # the same on the tiles' software model (amx_tiles.h; tests)
    ("dense_api.cpp", [], True),  # dense BF16 linears of the CPU-only model path (dense.h)
    ("dense_avx2.cpp", AVX2, True),
    ("dense_avx512.cpp", AVX512, False),
    ("attn_decode.cpp", AVX2 + ["-ffp-contract=off"], True),  # CPU-only decode attention (attn_decode.h)
    ("attn_decode_avx512.cpp", AVX512 + ["-ffp-contract=off"], False),  # its AVX-512 span
    ("attn_pool.cpp", [], True),  # its driver: units and spans over the pool's threads
    ("layer_decode.cpp", [], True),  # a decoder layer's attention half in one call (layer_decode.h)
    ("route_cpu.cpp", [], True),  # softmax top-k routing (fused_ops.topk_softmax on CPU, the one-call layer)
    ("lora.cpp", [], True),  # expert LoRA on the CPU experts (lora.h)
    ("lora_avx2.cpp", AVX2, True),
    ("lora_avx512.cpp", AVX512, False),
]
LINK_FLAGS = ["-shared", "-pthread"]


def _envs():
    """hybridmoe/envs.py, loaded by file path (see the module docstring)."""
    spec = importlib.util.spec_from_file_location("_hybridmoe_envs_for_build", ENVS_FILE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def lib_filename() -> str:
    return LIB_BASENAME + (sysconfig.get_config_var("SHLIB_SUFFIX") or ".so")


def _compiler() -> str:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or "c++"


def compile_units(out_dir: Path, cxx: str | None = None, log=print) -> list[Path]:
    """Compiles every unit into out_dir; returns the object files (optional failures skipped)."""
    cxx = cxx or _compiler()
    out_dir.mkdir(parents=True, exist_ok=True)
    objs = []
    if sys.platform != "linux" or os.uname().machine not in ("x86_64", "AMD64"):
        raise RuntimeError("the hybridmoe CPU engine is built for x86-64 Linux only")
    extra = _envs().cxxflags()
    for src, flags, required in UNITS:
        obj = out_dir / (src.rsplit(".", 1)[0] + ".o")
        cmd = [cxx, *BASE_FLAGS, *flags, *extra, "-c", str(CSRC / src), "-o", str(obj)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            if required:
                raise RuntimeError(f"compiling {src} failed:\n{' '.join(cmd)}\n{res.stderr}")
            log(f"hybridmoe: skipping {src} (compiler lacks its ISA flags): {res.stderr.strip()[:300]}")
            continue
        if res.stderr.strip():
            log(res.stderr.strip())
        objs.append(obj)
    return objs


def link(objs: list[Path], target: Path, cxx: str | None = None) -> Path:
    cxx = cxx or _compiler()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    cmd = [cxx, *LINK_FLAGS, *map(str, objs), "-o", str(tmp)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"linking failed:\n{' '.join(cmd)}\n{res.stderr}")
    os.replace(tmp, target)  # atomic: a process that already loaded the old file keeps it
    return target


def build_library(target: Path, log=print) -> Path:
    with tempfile.TemporaryDirectory(prefix="hybridmoe_build_") as d:
        return link(compile_units(Path(d), log=log), target)


def sources_digest() -> str:
    """Hash of the sources and flags, to notice a stale fallback build."""
    import hashlib

    h = hashlib.sha256(repr(UNITS).encode() + repr(BASE_FLAGS).encode())
    for p in sorted(CSRC.glob("*")):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()[:16]


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else CSRC.parent / lib_filename()
    print(build_library(out))
