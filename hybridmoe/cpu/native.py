"""Loads the CPU engine's native library (ctypes) and describes its C ABI.

Where the library comes from, first found wins: $HYBRIDMOE_CPU_LIB (hybridmoe/envs.py); the file
`pip install` built next to this module (if not older than the sources); a build of the sources
into ~/.cache/hybridmoe (a source checkout that was never installed).
ISA names: "avx2" < "avx512" < "amx"; $HYBRIDMOE_CPU_ISA forces one (an absent one is an error).
"""

from __future__ import annotations

import ctypes as C
import os
import threading
from pathlib import Path

from hybridmoe import envs
from hybridmoe.cpu import build as _build
from hybridmoe.cpu.settings import CPUEngineSettings

ABI_VERSION = 26  # csrc/api.cpp hm_abi_version
ISAS = {"avx2": 0, "avx512": 1, "amx": 2}
ISA_NAMES = {v: k for k, v in ISAS.items()}
DT_F32, DT_BF16 = 0, 1


class CpuIsaError(RuntimeError):
    """The requested ISA path cannot run on this CPU (or was not compiled)."""


class PackedMat(C.Structure):
    _fields_ = [
        ("data", C.c_void_p),
        ("expert_stride", C.c_int64),
        ("scale", C.c_void_p),
        ("zero", C.c_void_p),
        ("wsum", C.c_void_p),
        ("N", C.c_int),
        ("Kd", C.c_int),
    ]


class LayerDesc(C.Structure):
    _fields_ = [(n, C.c_int) for n in ("method", "E", "H", "I", "Hp", "Ip", "group", "act")] + [
        ("act_alpha", C.c_float),
        ("act_limit", C.c_float),
        ("w13", PackedMat),
        ("w2", PackedMat),
    ]


class GgufMat(C.Structure):
    """HmGgufMat (csrc/gguf_common.h): one stacked GGUF expert matrix [E, N, K] in the file's blocks."""

    _fields_ = [
        ("data", C.c_void_p),
        ("expert_stride", C.c_int64),
        ("row_bytes", C.c_int64),
        ("type", C.c_int32),
        ("N", C.c_int32),
        ("K", C.c_int32),
        ("pad_", C.c_int32),
    ]


class GgufDesc(C.Structure):
    """HmGgufDesc (csrc/gguf_common.h): a GGUF expert layer for hm_gguf_layer_create."""

    _fields_ = [(n, C.c_int32) for n in ("E", "H", "I", "act")] + [
        ("act_alpha", C.c_float),
        ("act_limit", C.c_float),
        ("gate", GgufMat),
        ("up", GgufMat),
        ("down", GgufMat),
    ]


class Task(C.Structure):
    _fields_ = [
        ("layer", C.c_void_p),
        ("x", C.c_void_p),
        ("ids", C.c_void_p),
        ("weights", C.c_void_p),
        ("skip", C.c_void_p),
        ("out", C.c_void_p),
        ("T", C.c_int64),
    ] + [(n, C.c_int32) for n in ("K", "x_dtype", "ids_dtype", "out_dtype", "accumulate")] + [
        ("nan_rows", C.c_int32),  # 1: a token's non-finite values make its output row NaN, not a task error
        ("lora_idx", C.c_void_p),  # int32 [T] adapter slot per token, -1 none (csrc/lora.h); may be None
        # a second pair group (csrc/moe.h): ids2 [T, K], its output out2 [T, H], and done1 (int32 set to 1 once
        # `out` is written); all None: one group
        ("ids2", C.c_void_p),
        ("out2", C.c_void_p),
        ("done1", C.c_void_p),
    ]


class PoolSettings(C.Structure):
    """HmPoolSettings (csrc/pool.h): a CPUEngineSettings as hm_pool_create takes it."""

    _fields_ = [
        ("prefetch_bytes", C.c_int64),
        ("spin_us", C.c_int64),
        ("hostfn_spin_us", C.c_int64),
        ("gate_timeout_s", C.c_double),
    ]

    @classmethod
    def of(cls, s: CPUEngineSettings) -> PoolSettings:
        return cls(s.prefetch_bytes, s.spin_us, s.hostfn_spin_us, float(s.gate_timeout_s))

    def to_settings(self) -> CPUEngineSettings:
        return CPUEngineSettings(self.prefetch_bytes, self.spin_us, self.hostfn_spin_us, self.gate_timeout_s)


class HostCall(C.Structure):
    """userdata of hm_submit_gated / hm_sync_hostfn (csrc/hostcall.cpp HmHostCall)."""

    _fields_ = [
        ("pool", C.c_void_p),
        ("task", Task),
        ("id", C.c_int64),
        ("max_pending", C.c_int64),
        ("status", C.c_int32),
        ("pad_", C.c_int32),
        ("head", C.c_int64),  # ids submitted and not yet waited for (a ring, oldest first)
        ("tail", C.c_int64),
        ("ring", C.c_int64 * 8),
        # int32* the task sets to 1 when done (None: waited for by hm_sync_hostfn instead; see hostcall.cpp)
        ("done", C.c_void_p),
    ]


class QuantSrc(C.Structure):
    """HmQuantSrc (csrc/quantize.h): the float matrices hm_quantize packs (data None: random values)."""

    _fields_ = [("data", C.c_void_p), ("dtype", C.c_int32), ("E", C.c_int32), ("N", C.c_int32), ("K", C.c_int32),
                ("expert_stride", C.c_int64), ("row_stride", C.c_int64), ("w13_inter", C.c_int32),
                ("pad_", C.c_int32), ("seed", C.c_uint64), ("std", C.c_double)]


class QuantDst(C.Structure):
    """HmQuantDst (csrc/quantize.h): where hm_quantize writes a PackedMatrix."""

    _fields_ = [("data", C.c_void_p), ("scale", C.c_void_p), ("zero", C.c_void_p), ("wsum", C.c_void_p),
                ("Np", C.c_int32), ("Kp", C.c_int32), ("method", C.c_int32), ("group", C.c_int32),
                ("symmetric", C.c_int32), ("pad_", C.c_int32)]


_lib = None
_lock = threading.Lock()


def _packaged_path() -> Path | None:
    """The library setuptools built next to this module (named with the interpreter's EXT_SUFFIX)."""
    found = sorted(Path(__file__).resolve().parent.glob(_build.LIB_BASENAME + "*.so"))
    return found[-1] if found else None


def _stale(lib: Path) -> bool:
    try:
        t = lib.stat().st_mtime
        return any(p.stat().st_mtime > t for p in _build.CSRC.glob("*"))
    except OSError:
        return True


def _locate() -> Path:
    env = envs.cpu_lib()
    if env is not None:
        return env
    pkg = _packaged_path()
    if pkg is not None and not _stale(pkg):
        return pkg
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hybridmoe" / _build.sources_digest()
    target = cache / _build.lib_filename()
    if not target.exists():
        _build.build_library(target, log=lambda m: None)
    return target


def _declare(lib) -> None:
    vp, i32, i64, cp = C.c_void_p, C.c_int, C.c_int64, C.c_char_p
    sig = {
        "hm_abi_version": (i32, []),
        "hm_cpu_features": (C.c_uint, []),
        "hm_isa_check": (i32, [i32, cp, i32]),
        "hm_isa_best": (i32, []),
        "hm_amx_emulated": (i32, []),
        "hm_pool_create": (vp, [i32, C.POINTER(C.c_int), i32, C.POINTER(PoolSettings), cp, i32]),
        "hm_pool_destroy": (None, [vp]),
        "hm_pool_size": (i32, [vp]),
        "hm_pool_num_sub": (i32, [vp]),
        "hm_pool_settings": (None, [vp, C.POINTER(PoolSettings)]),
        "hm_layer_create": (vp, [C.POINTER(LayerDesc), i32, cp, i32]),
        "hm_layer_destroy": (None, [vp]),
        "hm_gguf_layer_create": (vp, [C.POINTER(GgufDesc), i32, cp, i32]),
        "hm_gguf_layer_destroy": (None, [vp]),
        "hm_layer_kernel_name": (cp, [vp]),
        "hm_layer_bind_numa": (i32, [vp, C.POINTER(C.c_int), i32]),
        "hm_submit": (i64, [vp, C.POINTER(Task)]),
        "hm_sync": (i32, [vp, i64, i64, cp, i32]),
        "hm_run_task": (i32, [vp, C.POINTER(Task), i64, cp, i32]),
        "hm_pool_inline": (i32, [vp, i32]),
        "hm_pool_leader_spin": (i64, [vp, i64]),
        "hm_pool_selftest": (i64, [vp, i32, i32, i64, vp, vp]),
        "hm_pool_dynamic": (i32, [vp, i32]),
        "hm_pool_reduce_inline": (i32, [vp, i32]),
        "hm_pool_fuse": (i32, [vp, i32]),
        "hm_pool_block_prefetch": (i32, [vp, i32]),
        "hm_pool_items_per_thread": (i32, [vp, i32]),
        "hm_pool_prefetch": (i64, [vp, i64]),
        "hm_pending": (i64, [vp]),
        "hm_completed": (i64, [vp]),
        "hm_profile": (None, [C.POINTER(C.c_double), i32]),
        "hm_layer_profile": (None, [C.POINTER(C.c_double), i32]),
        "hm_sync_hostfn": (None, [vp]),
        "hm_sync2_hostfn": (None, [vp]),
        "hm_submit_gated": (None, [C.POINTER(HostCall), vp]),
        "hm_submit_gated_many": (None, [C.POINTER(C.POINTER(HostCall)), C.POINTER(vp), i32]),
        "hm_stream_read": (C.c_double, [vp, i64, i32]),
        "hm_quantize": (i32, [vp, C.POINTER(QuantSrc), C.POINTER(QuantDst), cp, i32]),
        "hm_trace_start": (None, [vp, i64]),
        "hm_trace_stop": (i64, [vp, C.POINTER(C.c_int64), i64]),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args


def lib():
    """The loaded library (ctypes.CDLL: calls release the GIL)."""
    global _lib
    with _lock:
        if _lib is None:
            path = _locate()
            handle = C.CDLL(str(path))
            _declare(handle)
            if handle.hm_abi_version() != ABI_VERSION:
                raise RuntimeError(f"{path}: unexpected ABI version {handle.hm_abi_version()} (want {ABI_VERSION}); "
                                   "rebuild with pip install -e .")
            _lib = handle
        return _lib


def isa_missing(isa: str) -> str:
    """'' when the ISA path can run here, else why not."""
    if isa not in ISAS:
        raise CpuIsaError(f"unknown CPU ISA {isa!r}; choose one of {sorted(ISAS)}")
    buf = C.create_string_buffer(512)
    ok = lib().hm_isa_check(ISAS[isa], buf, len(buf))
    return "" if ok else buf.value.decode()


def available_isas() -> list[str]:
    return [name for name in ISAS if not isa_missing(name)]


def amx_emulated() -> bool:
    """True when the "amx" path runs on the software model of the AMX tiles (csrc/amx_tiles.h): a CPU
    without AMX but with AVX-512, and $HYBRIDMOE_AMX_EMULATE=1 set before the library loaded (tests)."""
    return bool(lib().hm_amx_emulated())


def best_isa() -> str:
    best = lib().hm_isa_best()
    if best < 0:
        raise CpuIsaError(f"the CPU expert engine needs at least AVX2+FMA+F16C: {isa_missing('avx2')}")
    return ISA_NAMES[best]


def resolve_isa(isa: str | None = None) -> str:
    """isa, else $HYBRIDMOE_CPU_ISA, else the best available; raises CpuIsaError if it cannot run."""
    isa = isa or envs.cpu_isa()
    if isa is None:
        return best_isa()
    isa = isa.lower()
    why = isa_missing(isa)
    if why:
        raise CpuIsaError(f"CPU ISA path {isa!r} was requested but cannot run here: {why}")
    return isa


PROFILE_PHASES = ("route", "quant1", "gemm1", "quant2", "gemm2", "reduce", "lora")  # lora: the expert LoRA
# set-up of a task (csrc/lora.cpp lora_begin); its rank products and B terms run inside gemm1 and gemm2


def profile(reset: bool = True) -> dict[str, float]:
    """Seconds spent in each task phase since the last reset (all pools), and the task count."""
    buf = (C.c_double * 8)()
    lib().hm_profile(buf, int(reset))
    res = dict(zip(PROFILE_PHASES, buf[:6] + [buf[7]]))
    res["tasks"] = buf[6]
    return res


LAYER_PARTS = ("norms", "qkv", "attention", "o_proj", "router", "routing", "moe_task")


def layer_profile(reset: bool = True) -> dict[str, float]:
    """Seconds spent in each part of the one-call decoder layers (csrc/layer_decode.cpp) since the last
    reset, each part with its pool phase's start and barrier, and the call count ("calls")."""
    buf = (C.c_double * 8)()
    lib().hm_layer_profile(buf, int(reset))
    res = dict(zip(LAYER_PARTS, buf[:7]))
    res["calls"] = buf[7]
    return res


def report() -> dict:
    """What `hybridmoe check` can print about the CPU engine."""
    from hybridmoe.cpu import topology

    return {
        "library": str(_locate()),
        "isa_paths": {name: (isa_missing(name) or "ok") for name in ISAS},
        "best_isa": ISA_NAMES.get(lib().hm_isa_best(), "none (AVX2 missing)"),
        "physical_cores": len(topology.physical_cores()),
        "numa_nodes": sorted(topology.numa_nodes()),
        "default_threads": topology.default_threads(),
    }


class HostCallPair(C.Structure):
    """userdata of hm_sync2_hostfn: two HostCalls waited for by one host function (a first, then
    b). The HostCalls must outlive the pair."""

    _fields_ = [("a", C.POINTER(HostCall)), ("b", C.POINTER(HostCall))]


def wait_host_functions() -> tuple[int, int]:
    """Addresses of hm_sync_hostfn (userdata: a HostCall) and hm_sync2_hostfn (userdata: a
    HostCallPair), CUhostFn entry points (void fn(void* userdata)) for cuLaunchHostFunc."""
    lb = lib()
    return (C.cast(lb.hm_sync_hostfn, C.c_void_p).value, C.cast(lb.hm_sync2_hostfn, C.c_void_p).value)
