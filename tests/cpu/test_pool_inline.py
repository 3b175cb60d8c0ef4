"""Synchronous pool calls run on the caller in the leader's place (ThreadPool::run_inline,
hm_run_task, hm_dense): the same results bit for bit as the queued path, tasks already queued run
first, errors are raised either way, and the pool keeps working after a failed task."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.cpu.dense import dense_linear
from hybridmoe.cpu.engine import CPUMoEError, CPUMoELayer, CPUThreadPool
from hybridmoe.cpu.pack import pack_layer


@pytest.fixture(scope="module")
def pool():
    p = CPUThreadPool(2)
    yield p
    p.close()


def _layer(pool, e=6, h=96, i=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) * 0.05
    w2 = torch.randn(e, h, i, generator=g) * 0.05
    return CPUMoELayer(pack_layer(w13, w2, "AMXINT8"), pool=pool)


@pytest.mark.parametrize("t", [1, 3, 40])
def test_inline_equals_queued(pool, t):
    layer = _layer(pool)
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, 96, generator=g).bfloat16()
    ids = torch.randint(0, 6, (t, 2), generator=g, dtype=torch.int32)
    w = torch.rand(t, 2, generator=g)
    wd = torch.randn(300, 96, generator=g).bfloat16()  # 57 KB: the caller alone; 600 rows: a phase
    wd2 = torch.randn(600, 96, generator=g).bfloat16()
    assert pool.run_inline
    got = [layer.forward(x, ids, w), dense_linear(x[:1], wd, pool=pool), dense_linear(x[:2], wd2, pool=pool)]
    pool.run_inline = False
    try:
        ref = [layer.forward(x, ids, w), dense_linear(x[:1], wd, pool=pool), dense_linear(x[:2], wd2, pool=pool)]
    finally:
        pool.run_inline = True
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_queued_tasks_run_first_and_errors_are_raised(pool):
    layer = _layer(pool, seed=1)
    x = torch.randn(4, 96).bfloat16()
    ids = torch.randint(0, 6, (4, 2), dtype=torch.int32)
    w = torch.rand(4, 2)
    ref = layer.forward(x, ids, w)
    out = torch.zeros(4, 96, dtype=torch.bfloat16)
    tid = layer.submit(x, ids, w, out)  # queued: the next synchronous call waits behind it
    again = layer.forward(x, ids, w)
    assert pool.pending() == 0 and torch.equal(again, ref)
    layer.sync(tid)
    assert torch.equal(out, ref)
    bad = ids.clone()
    bad[1, 0] = 6  # out of range
    for inline in (True, False):
        pool.run_inline = inline
        try:
            with pytest.raises(CPUMoEError, match="out of range"):
                layer.forward(x, bad, w)
            assert torch.equal(layer.forward(x, ids, w), ref)  # and the pool still works
        finally:
            pool.run_inline = True


def test_leader_spin_setting(pool):
    """leader_spin_us: -1 (the pool's spin) by default; 0 makes the leader sleep as soon as its queue is
    empty, and a later submit wakes it (queued tasks give the same results, many times over); bounds."""
    assert pool.leader_spin_us == -1
    layer = _layer(pool, seed=2)
    x = torch.randn(3, 96).bfloat16()
    ids = torch.randint(0, 6, (3, 2), dtype=torch.int32)
    w = torch.rand(3, 2)
    ref = layer.forward(x, ids, w)
    pool.leader_spin_us = 0
    try:
        assert pool.leader_spin_us == 0
        for _ in range(50):  # each queued task after the leader went to sleep
            out = torch.zeros(3, 96, dtype=torch.bfloat16)
            layer.sync(layer.submit(x, ids, w, out))
            assert torch.equal(out, ref)
        pool.leader_spin_us = 250
        assert pool.leader_spin_us == 250
        for bad in (-2, 10**6 + 1):
            with pytest.raises(ValueError, match="leader_spin_us"):
                pool.leader_spin_us = bad
        assert pool.leader_spin_us == 250
    finally:
        pool.leader_spin_us = -1
    assert pool.leader_spin_us == -1
