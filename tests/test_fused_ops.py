"""Fused decoder-layer kernels (RMSNorm+residual, q/k norm + RoPE, top-k softmax routing) against
their torch references: under the Triton interpreter on CPU (a subprocess, since the interpreter
must be chosen before triton is imported), and on CUDA when present."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def check(device: str, dtype: torch.dtype, tol: float) -> None:
    from hybridmoe.layers import fused_ops as F
    from hybridmoe.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    def close(a, b, what):
        err = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()
        assert err <= tol, f"{what} {dtype}: relative error {err:.2e} > {tol}"

    for t, h in ((1, 72), (5, 128), (33, 200)):
        x, r, w = rand(t, h), rand(t, h), rand(h)
        out, res = F.add_rmsnorm(x, r, w, 1e-6)
        ref_out, ref_res = F.add_rmsnorm_ref(x, r, w, 1e-6)
        close(out, ref_out, "add_rmsnorm")
        close(res, ref_res, "residual")
        close(F.add_rmsnorm(x, None, w, 1e-6)[0], F.add_rmsnorm_ref(x, None, w, 1e-6)[0], "rmsnorm")
    rope = RotaryEmbedding(48, 300, 10000.0)
    for t, nh, d in ((1, 3, 48), (7, 2, 48), (40, 5, 48)):
        x = rand(t, nh, d)
        pos = torch.randint(0, 300, (t,), generator=g).to(device)
        cos, sin = rope.cos.to(device), rope.sin.to(device)
        for wt in (rand(d), None):
            got = F.qk_norm_rope(x, wt, 1e-6, cos, sin, pos)
            close(got, F.qk_norm_rope_ref(x, wt, 1e-6, cos, sin, pos), f"qk_norm_rope(norm={wt is not None})")
    for t, e, k, renorm in ((1, 128, 8, True), (9, 10, 3, True), (17, 60, 4, False), (3, 6, 6, True)):
        logits = rand(t, e)
        w, ids = F.topk_softmax(logits, k, renorm)
        rw, rids = F.topk_softmax_ref(logits, k, renorm)
        assert torch.equal(ids.cpu().sort(-1).values, rids.cpu().sort(-1).values), "topk ids"
        close(w.sort(-1).values, rw.sort(-1).values, "topk weights")
        assert ids.dtype == torch.int32 and w.dtype == torch.float32


def test_interpreter_fp32():
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = "import torch, test_fused_ops as t; t.check('cpu', torch.float32, 1e-5); t.check('cpu', torch.float16, 2e-3)"
    res = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_cuda(dtype, tol):
    check("cuda", dtype, tol)
