"""The hybrid layer's fused hand-over kernels (moe/hybrid_kernels.py) against their torch
references: under the Triton interpreter on CPU (a subprocess: the interpreter is chosen before
triton is imported), and on CUDA with the host-side tensors in pinned memory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def check(device: str, pinned: bool, out_dtype: torch.dtype) -> None:
    from hybridmoe.moe import hybrid_kernels as HK

    g = torch.Generator().manual_seed(0)
    for t, h, e, k, n_gpu in ((1, 72, 10, 3, 4), (5, 200, 16, 8, 0), (9, 1030, 7, 7, 7), (3, 64, 12, 4, 5)):
        x = torch.randn(t, h + 3, generator=g).to(device, torch.bfloat16)[:, :h]  # a row stride, as a view
        ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k].to(device)
        w = torch.rand(t, k, generator=g).to(device)
        mask = torch.zeros(e, dtype=torch.bool)
        mask[torch.randperm(e, generator=g)[:n_gpu]] = True
        gl = torch.where(mask, mask.cumsum(0) - 1, -1).to(device, torch.int32)
        cl = torch.where(~mask, (~mask).cumsum(0) - 1, -1).to(device, torch.int32)
        outs = []
        for fn in (HK.split_stage, HK.split_stage_ref):
            dev = [torch.full((t, k), 99, dtype=torch.int32, device=device), torch.full((t, k), 9.0, device=device)]
            host = [torch.full((t, h), 7.0, dtype=torch.bfloat16), torch.full((t, k), 99, dtype=torch.int32),
                    torch.full((t, k), 9.0)]
            if pinned:
                host = [v.pin_memory() for v in host]
            fn(x, ids, w, gl, cl, *dev, *host)
            outs.append([v.cpu() for v in dev + host])
        for name, a, b in zip(("gid", "gw", "host_x", "host_ids", "host_w"), *outs):
            assert torch.equal(a, b), f"split_stage {name} (T={t}, H={h}, K={k}, {n_gpu} GPU experts)"
        hout = torch.randn(t, h, generator=g)
        if pinned:
            hout = hout.pin_memory()
        for gout in (torch.randn(t, h, generator=g).to(device, out_dtype), None):
            got = HK.combine(gout, hout, out_dtype, torch.device(device))
            assert torch.equal(got.cpu(), HK.combine_ref(gout, hout, out_dtype).cpu()), "combine"


def test_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    # fp16 for combine: the interpreter rounds fp32 -> bf16 by truncation, the GPU to nearest
    code = "import torch, test_hybrid_kernels as t; t.check('cpu', False, torch.float16); print('ok')"
    res = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


@pytest.mark.gpu
def test_cuda_with_pinned_host_buffers():
    from hybridmoe.moe import hybrid_kernels as HK

    check("cuda", True, torch.bfloat16)
    assert HK.host_pointers_ok(torch.device("cuda"))
