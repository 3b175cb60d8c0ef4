"""The CPU expert engine's tuning settings: fixed when a pool is created, passed to the native pool.

The defaults are the measured best on the H200 host (benchmarks/results/). Product code gets them
from the hybrid configuration; benchmarks and tests build their own. No torch import here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

MAX_PREFETCH_BYTES = 1 << 20
MAX_SPIN_US = 1_000_000
MAX_GATE_TIMEOUT_S = 86_400.0


@dataclass(frozen=True)
class CPUEngineSettings:
    """Settings of one CPU thread pool (hybridmoe.cpu.engine.CPUThreadPool). Out-of-range values
    raise ValueError naming the field."""

    prefetch_bytes: int = field(default_factory=lambda: default_prefetch_bytes())
    """Software prefetch distance of the decode-sized (few-row) kernels and the dense GEMVs, bytes
    ahead of the weight stream, in [0, 1 MiB]; 0: the hardware prefetchers alone. Default by CPU
    vendor and ISA (default_prefetch_bytes):
    - Intel with AVX-512: 4096 (64 lines). 2048 read 10-30% faster than none on the H200 host (session 4). 4096 against
      2048, interleaved on the H100 host (session 34, benchmarks/results/session34): AMXINT8 / AMXINT4 at
      T = 1, 4, 16 faster in 17 of 18 pairs (by -2 to +16%), GGUF Q4_K / Q8_0 faster in 12 of 12 (+1 to +16%
      by medians); CPU-only decode +4.8% on the H200 host (session 20); GGUF within 3% either way in
      session 23.
    - AMD with AVX-512: 0. None read about 5% faster than 2048 on a Zen 4 machine (AMXINT8 / AMXINT4 / BF16
      layers at T = 1, 4, 16, interleaved, session 13).
    - Other CPUs, those without AVX-512 (the AVX2 kernels) among them: 2048. It read 5-13% faster than none on
      a 2-core Zen 3 machine (AMXINT8 / AMXINT4 at T = 1, 4, three interleaved rounds, session 25; GGUF Q4_K /
      Q8_0 the same within 3%).
    The AMX tile kernels (many rows) prefetch each weight block this far ahead too. Results do not depend on it."""

    spin_us: int = 1000
    """How long idle pool threads (and Python's waits) spin before they sleep, microseconds, in
    [0, 1 s]. Spinning threads start the next phase or task sooner; sleeping ones free the cores."""

    hostfn_spin_us: int = 0
    """How long a CUDA host function waiting for a CPU task spins before it sleeps, microseconds,
    in [-1, 1 s]; -1: `spin_us`. The driver's callback thread is not one of the pool's pinned
    threads: spinning, it competes with them for a core for as long as the task runs. 0 (sleep at
    once) made a hybrid decode step 8-17% faster than a 1 ms spin on the H200 host (session 5)."""

    gate_timeout_s: float = 60.0
    """How long a gated CPU task (queued ahead, started by a word the GPU writes) waits for the GPU
    before it is skipped with an error (a graph launch that failed), seconds, in (0, 1 day]."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "gate_timeout_s":
                ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                ok = ok and 0 < v <= MAX_GATE_TIMEOUT_S
                rng = f"(0, {MAX_GATE_TIMEOUT_S:g}] seconds"
            else:
                lo, hi = {"prefetch_bytes": (0, MAX_PREFETCH_BYTES), "spin_us": (0, MAX_SPIN_US),
                          "hostfn_spin_us": (-1, MAX_SPIN_US)}[f.name]
                ok = isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi
                rng = f"an integer in [{lo}, {hi}]"
            if not ok:
                raise ValueError(f"CPUEngineSettings.{f.name}={v!r}: expected {rng}")


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD", ...), "" where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> set[str]:
    """/proc/cpuinfo's flags of the first CPU (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def default_prefetch_bytes() -> int:
    """CPUEngineSettings.prefetch_bytes' default here: 4096 on Intel CPUs with AVX-512, 0 on AMD CPUs with
    AVX-512 (VNNI), 2048 elsewhere: CPUs without AVX-512 (whose kernels are the AVX2 ones) of either vendor
    included (see that field)."""
    vendor, flags = cpu_vendor(), cpu_flags()
    if vendor == "GenuineIntel" and "avx512f" in flags:
        return 4096
    return 0 if vendor == "AuthenticAMD" and {"avx512f", "avx512_vnni"} <= flags else 2048
