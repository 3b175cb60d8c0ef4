"""AMX CPU MoE tasks run on the calling thread (CPUThreadPool.inline_amx) between torch's own bf16
matmuls on that thread: no SIGILL, the results of the queued path bit for bit. Needs an AMX CPU (the
H200 host; skipped elsewhere, CI included).

Why: on the H200 host an inline AMX task on the Python thread died with SIGILL, so AMX tasks were kept
on the pool threads. The suspected cause: the tile configuration was loaded once per thread (a
thread-local flag), and torch's AMX matmuls (oneDNN) release the thread's tiles when they finish,
after which a tile load is #UD. moe_amx.cpp now loads it at every AMX GEMM call. Run in a subprocess,
so a SIGILL fails this test instead of the whole run. When it passes on an AMX host, inline AMX can
become the default (hm_run_task in csrc/api.cpp).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hybridmoe.cpu import native

CHILD = r"""
import torch
from hybridmoe.cpu.engine import CPUMoELayer, CPUThreadPool
from hybridmoe.cpu.pack import pack_layer

pool = CPUThreadPool(2)
pool.inline_amx = True
assert pool.run_inline and pool.inline_amx
g = torch.Generator().manual_seed(0)
e, h, i, t = 8, 256, 128, 96  # 96 rows: the AMX tile kernels, not the few-row AVX-512 ones
layer = CPUMoELayer(pack_layer(torch.randn(e, 2 * i, h, generator=g) * 0.05, torch.randn(e, h, i, generator=g) * 0.05,
                               "AMXINT8"), pool=pool, isa="amx")
x = torch.randn(t, h, generator=g).bfloat16()
ids = torch.randint(0, e, (t, 2), generator=g, dtype=torch.int32)
w = torch.rand(t, 2, generator=g)
a = torch.randn(512, 512, generator=g).bfloat16()
pool.run_inline = False
ref = layer.forward(x, ids, w)  # on the pool's threads
pool.inline_amx = True
for _ in range(3):
    (a @ a).sum().item()  # torch's bf16 matmul on this thread: oneDNN's AMX kernel, then its tile release
    assert torch.equal(layer.forward(x, ids, w), ref)
print("OK")
"""


@pytest.mark.skipif(native.isa_missing("amx") is not None, reason="needs a CPU with AMX")
def test_inline_amx_task_after_torch_matmuls_on_the_same_thread():
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDMOE_CPU_ISA"}
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), (p.returncode, p.stderr[-3000:])


def test_inline_amx_setting_round_trips(monkeypatch):
    from hybridmoe.cpu.engine import CPUThreadPool

    monkeypatch.delenv("HYBRIDMOE_AMX_INLINE", raising=False)
    pool = CPUThreadPool(1)
    try:
        assert pool.run_inline and not pool.inline_amx  # the default: AMX tasks on the pool threads
        pool.inline_amx = True
        assert pool.run_inline and pool.inline_amx
        pool.run_inline = False
        assert not pool.run_inline and not pool.inline_amx
        pool.run_inline = True
        assert pool.run_inline and not pool.inline_amx
    finally:
        pool.close()
    monkeypatch.setenv("HYBRIDMOE_AMX_INLINE", "1")
    pool = CPUThreadPool(1)
    try:
        assert pool.run_inline and pool.inline_amx
    finally:
        pool.close()
