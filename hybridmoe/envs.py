"""Development-only environment variables, all read here (each read when asked, so a test can set one).

Product behaviour is configured by flags and config objects (the CPU engine's tuning by
`hybridmoe.cpu.settings.CPUEngineSettings`), never by the environment. These variables are for
working on hybridmoe itself:

| variable | default | effect |
|---|---|---|
| `HYBRIDMOE_CPU_LIB` | the built library | load the CPU engine's native library from this file |
| `HYBRIDMOE_CPU_ISA` | best available | force the CPU kernels' ISA path: `avx2`, `avx512` or `amx` (a missing one is an error) |
| `HYBRIDMOE_CXXFLAGS` | none | extra compiler flags for the native library's build (`-g`, `-fsanitize=address`, ...) |
| `HYBRIDMOE_MOE_CONFIG_DIR` | `hybridmoe/moe/configs` | where the fused MoE kernel's tuned tiles are read (`sweep_moe_decode.py --write`) |
| `HYBRIDMOE_TEST_THREADS` | 2 | threads of the CPU engine tests' shared pool (tests/cpu/conftest.py) |
| `HYBRIDMOE_HUGEPAGES` | 1 | `0`: CPU weights on plain 4 KB pages, not advised for huge ones (hybridmoe/cpu/hugepages.py; A/B runs) |
| `HYBRIDMOE_PIN_CALLER` | 0 | `1`: CPU-only decode steps on the pool leader's CPU, its spin 0 (hybridmoe/cpu/caller_pin.py; A/B runs) |
| `HYBRIDMOE_LORA_FUSED` | 1 | `0`: LoRA linears keep the unfused form, GEMM + shrink + expand (hybridmoe/lora/linear.py; A/B runs) |
| `HYBRIDMOE_AMX_EMULATE` | 0 | `1` (read by the native library at load): where the CPU lacks AMX but has AVX-512, the `amx` path runs the AMX kernels on a software model of the tiles (csrc/amx_tiles.h; tests, never the default path) |
| `HYBRIDMOE_ALIGN_LARGE` | `grid` | the fused MoE's expert grouping above 256 pairs under `auto`: `torch` (sort-based) or `grid` (three Triton kernels) (hybridmoe/moe/triton_moe_kernels.py; A/B runs) |
| `HYBRIDMOE_MOE_DIRECT` | 1 | `0`: a one-token forward of the fused MoE groups its pairs by expert (align) as larger ones do, not one pair a block without grouping (hybridmoe/moe/triton_moe_kernels.py; A/B runs) |
| `HYBRIDMOE_ROUTER_FUSED` | 1 | `0`: a one-token MoE router on CUDA runs as two launches (GEMV, then top-k), not the fused kernel of hybridmoe/moe/router_triton.py (A/B runs) |
| `HYBRIDMOE_HANDOFF_FUSED` | 1 | `0`: a hybrid MoE layer on CUDA hands over to its CPU task by copies and separate small kernels, not the two kernels of hybridmoe/moe/handoff_triton.py (A/B runs) |
| `HYBRIDMOE_AMX_INLINE` | 0 | `1`: synchronous CPU MoE tasks of AMX layers run on the calling thread too (CPUThreadPool.inline_amx; tests/cpu/test_amx_caller_thread.py) |

Nothing here imports the rest of the package (or torch): hybridmoe/cpu/build.py, which setup.py
loads by file path before the package is importable, loads this file by path too.
"""

from __future__ import annotations

import os
from pathlib import Path

CPU_LIB = "HYBRIDMOE_CPU_LIB"
CPU_ISA = "HYBRIDMOE_CPU_ISA"
CXXFLAGS = "HYBRIDMOE_CXXFLAGS"
MOE_CONFIG_DIR = "HYBRIDMOE_MOE_CONFIG_DIR"
TEST_THREADS = "HYBRIDMOE_TEST_THREADS"
HUGEPAGES = "HYBRIDMOE_HUGEPAGES"
PIN_CALLER = "HYBRIDMOE_PIN_CALLER"
AMX_INLINE = "HYBRIDMOE_AMX_INLINE"
HANDOFF_FUSED = "HYBRIDMOE_HANDOFF_FUSED"
AMX_EMULATE = "HYBRIDMOE_AMX_EMULATE"
LORA_FUSED = "HYBRIDMOE_LORA_FUSED"
ALIGN_LARGE = "HYBRIDMOE_ALIGN_LARGE"
MOE_DIRECT = "HYBRIDMOE_MOE_DIRECT"
ROUTER_FUSED = "HYBRIDMOE_ROUTER_FUSED"


def _get(name: str) -> str | None:
    """The variable's value, None when unset or empty."""
    return os.environ.get(name) or None


def cpu_lib() -> Path | None:
    """$HYBRIDMOE_CPU_LIB: the native CPU library to load instead of the built one."""
    v = _get(CPU_LIB)
    return Path(v) if v else None


def cpu_isa() -> str | None:
    """$HYBRIDMOE_CPU_ISA, lower-cased: the ISA path every CPU layer must use (checked by
    hybridmoe.cpu.native.resolve_isa)."""
    v = _get(CPU_ISA)
    return v.strip().lower() if v else None


def cxxflags() -> list[str]:
    """$HYBRIDMOE_CXXFLAGS split on whitespace: appended to every compile of the native library."""
    return (_get(CXXFLAGS) or "").split()


def moe_config_dir() -> Path | None:
    """$HYBRIDMOE_MOE_CONFIG_DIR: the directory of the fused MoE kernel's tuned tile tables."""
    v = _get(MOE_CONFIG_DIR)
    return Path(v) if v else None


def threads_for_tests(default: int = 2) -> int:
    """$HYBRIDMOE_TEST_THREADS: threads of the CPU tests' shared pool (a positive integer)."""
    v = _get(TEST_THREADS)
    if v is None:
        return default
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{TEST_THREADS}={v!r}: expected a positive integer")
    return n


def hugepages() -> bool:
    """$HYBRIDMOE_HUGEPAGES: False when "0" (CPU weights stay on 4 KB pages); default 1."""
    return _switch(HUGEPAGES, True)


def pin_caller() -> bool | None:
    """$HYBRIDMOE_PIN_CALLER: True for "1", False for "0", None when unset (off)."""
    v = _get(PIN_CALLER)
    if v is None:
        return None
    if v not in ("0", "1"):
        raise ValueError(f"{PIN_CALLER}={v!r}: expected 0 or 1")
    return v == "1"


def align_large(default: str) -> str:
    """$HYBRIDMOE_ALIGN_LARGE: the align method "auto" takes above its one-program limit ("torch" or "grid")."""
    v = _get(ALIGN_LARGE)
    if v is None:
        return default
    if v not in ("torch", "grid"):
        raise ValueError(f"{ALIGN_LARGE}={v!r}: expected torch or grid")
    return v


def moe_direct() -> bool:
    """$HYBRIDMOE_MOE_DIRECT: whether one-token fused MoE forwards skip the expert grouping (default 1)."""
    return _switch(MOE_DIRECT, True)


def amx_inline() -> bool:
    """$HYBRIDMOE_AMX_INLINE=1: new CPU pools run AMX layers' synchronous tasks on the caller too (default 0)."""
    return _switch(AMX_INLINE, False)


def lora_fused() -> bool:
    """$HYBRIDMOE_LORA_FUSED: False when "0" (LoRA linears never take the fused form); default 1."""
    return _switch(LORA_FUSED, True)


def router_fused() -> bool:
    """$HYBRIDMOE_ROUTER_FUSED: whether one-token MoE routers on CUDA take the fused kernel (default 1)."""
    return _switch(ROUTER_FUSED, True)


def handoff_fused() -> bool:
    """$HYBRIDMOE_HANDOFF_FUSED: whether hybrid MoE layers on CUDA take handoff_triton.py's kernels (default 1)."""
    return _switch(HANDOFF_FUSED, True)


def _switch(name: str, default: bool) -> bool:
    """A 0/1 variable: its value, the default when unset; anything else is an error naming it."""
    v = _get(name)
    if v is None:
        return default
    if v not in ("0", "1"):
        raise ValueError(f"{name}={v!r}: expected 0 or 1")
    return v == "1"
