"""The native pool's phase protocol (csrc/threadpool.cpp ThreadPool::parallel, via hm_pool_selftest):
classic phases run on every thread exactly once; dynamic phases (work claimed from a counter) do every
item exactly once whoever joins, and threads that join after the work is all taken skip the phase instead
of being waited for; classic and dynamic phases alternate safely with late threads around, with the pool's
threads sleeping between phases (spin 0) and spinning, and beside a busy process on the same cores.
"""

from __future__ import annotations

import ctypes as C
import multiprocessing as mp

import pytest
import torch

from hybridmoe.cpu import native
from hybridmoe.cpu.engine import CPUThreadPool
from hybridmoe.cpu.settings import CPUEngineSettings


def _run(pool: CPUThreadPool, phases: int, items: int, spin_ns: int) -> int:
    ic = torch.zeros(phases, items, dtype=torch.int32)
    tc = torch.zeros(phases, pool.threads, dtype=torch.int32)
    skipped = native.lib().hm_pool_selftest(pool.handle, phases, items, spin_ns, C.c_void_p(ic.data_ptr()),
                                            C.c_void_p(tc.data_ptr()))
    assert skipped >= 0
    dyn, cls = ic[1::2], tc[0::2]
    assert torch.equal(dyn, torch.ones_like(dyn)), "a dynamic phase lost or repeated an item"
    assert torch.equal(cls, torch.ones_like(cls)), "a classic phase missed or repeated a thread"
    assert not ic[0::2].any() and not tc[1::2].any()
    return int(skipped)


def _busy(seconds: float) -> None:
    import time

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass


@pytest.mark.parametrize("spin_us", [0, 1000])
@pytest.mark.parametrize("threads", [2, 3])
def test_phases_exactly_once(spin_us, threads):
    pool = CPUThreadPool(threads=threads, settings=CPUEngineSettings(spin_us=spin_us))
    try:
        skipped = _run(pool, 2000, 37, 0)  # tiny items: the caller often takes them all before a worker joins
        _run(pool, 400, 64, 2000)  # items that take a while: workers join and share them
        if spin_us == 0:  # workers asleep between phases wake after the work is gone: the skip path ran
            assert skipped > 0
    finally:
        pool.close()


def test_phases_beside_a_busy_process():
    """A process spinning on the same cores: preempted pool threads join late, nothing is lost or doubled."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_busy, args=(3.0,)) for _ in range(2)]
    for p in procs:
        p.start()
    pool = CPUThreadPool(threads=2)
    try:
        _run(pool, 600, 50, 1000)
    finally:
        pool.close()
        for p in procs:
            p.join()


def test_dynamic_switch():
    """Switched off, dynamic phases wait for every thread (no skip, still exactly once); back on, they skip."""
    pool = CPUThreadPool(threads=2, settings=CPUEngineSettings(spin_us=0))
    try:
        assert pool.dynamic_phases
        pool.dynamic_phases = False
        assert not pool.dynamic_phases
        assert _run(pool, 1000, 37, 0) == 0  # every thread joined every phase
        pool.dynamic_phases = True
        assert _run(pool, 2000, 37, 0) > 0
    finally:
        pool.close()


def test_prefetch_setting_changes_no_result():
    """The prefetch distance can change between calls (benchmarks); results do not depend on it."""
    from hybridmoe.cpu.dense import dense_linear

    pool = CPUThreadPool(threads=2)
    try:
        default = pool.prefetch_bytes
        assert default == pool.settings.prefetch_bytes
        g = torch.Generator().manual_seed(5)
        w = torch.randn(4099, 2048, generator=g).bfloat16()  # 16 MB: on the pool's threads
        x = torch.randn(1, 2048, generator=g).bfloat16()
        outs = []
        for pf in (0, 4096, 65536, default):
            pool.prefetch_bytes = pf
            assert pool.prefetch_bytes == pf
            outs.append(dense_linear(x, w, pool=pool))
        assert all(torch.equal(outs[0], o) for o in outs[1:])
        for bad in (-1, (1 << 20) + 1, True):
            with pytest.raises(ValueError, match="prefetch_bytes"):
                pool.prefetch_bytes = bad
        assert pool.prefetch_bytes == default
    finally:
        pool.close()
