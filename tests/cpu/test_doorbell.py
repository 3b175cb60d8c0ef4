"""Doorbells (native hm_doorbell_add): the CPU side of the stream-memory-operation hand-over. Here
the host plays the stream: it writes go=1 and waits for done=1, as cuStreamWriteValue32 /
cuStreamWaitValue32 do on a GPU. Results against the pure-torch reference; a failing task still
rings done (the stream must never hang) and sets the call's status; the next task runs normally."""

from __future__ import annotations

import time

import torch

from hybridmoe.cpu import native
from hybridmoe.cpu.engine import CPUMoELayer, CPUThreadPool
from hybridmoe.cpu.quant import pack_layer
from hybridmoe.cpu.reference import moe_reference
from hybridmoe.moe.cuda_bridge import Doorbell


def _wait_done(bell: Doorbell, timeout: float = 20.0) -> None:
    t0 = time.time()
    while int(bell.words[1]) != 1:
        assert time.time() - t0 < timeout, "done was never rung"
        time.sleep(1e-4)
    bell.words[1] = 0  # what the stream does after its wait


def test_doorbell_rounds_and_failure():
    g = torch.Generator().manual_seed(0)
    e, h, i, k = 6, 72, 40, 3
    gu, dn = torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1
    pool = CPUThreadPool(2)
    layer = CPUMoELayer(pack_layer(gu, dn, "BF16"), pool=pool)
    bells = []
    for t in (1, 5):  # two calls (as two token counts of one layer), each with its own buffers
        x = torch.zeros(t, h)
        ids = torch.zeros(t, k, dtype=torch.int32)
        w = torch.zeros(t, k)
        out = torch.zeros(t, h)
        task, keep = layer.make_task(x, ids, w, out)
        call = native.HostCall(pool.handle, task, 0, 0, 0, 0)
        bells.append((Doorbell(pool.handle, call, pinned=False), call, keep))
    for rnd in range(4):
        for bell, call, (x, ids, w, out, _) in bells:
            t = x.shape[0]
            x.copy_(torch.randn(t, h, generator=g))
            ids.copy_(torch.rand(t, e, generator=g).argsort(dim=1)[:, :k].int())
            w.copy_(torch.rand(t, k, generator=g))
            if rnd == 2 and t == 5:
                x[3, 7] = float("nan")  # this round's task fails
            bell.words[0] = 1  # ring
            _wait_done(bell)
            assert int(bell.words[0]) == 0, "the watcher clears go"
            if rnd == 2 and t == 5:
                assert call.status == 1
                continue
            assert call.status == 0
            ref = moe_reference(x, ids.long(), w, gu.bfloat16().float(), dn.bfloat16().float())
            err = ((out - ref).norm() / ref.norm()).item()
            assert err < 1e-2, f"round {rnd}, T={t}: relative error {err:.2e}"
    native.lib().hm_doorbell_clear(pool.handle)
    bell = bells[0][0]
    bell.words[0] = 1  # a forgotten doorbell: nothing answers any more
    time.sleep(0.05)
    assert int(bell.words[1]) == 0 and int(bell.words[0]) == 1
    pool.close()
