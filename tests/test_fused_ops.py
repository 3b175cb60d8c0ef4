"""Fused decoder-layer kernels (RMSNorm+residual, q/k norm + RoPE (+ KV store), top-k softmax routing) against
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
    for t, hq, hkv, d in ((1, 4, 2, 48), (6, 3, 3, 48), (19, 8, 1, 48)):
        qkv = rand(t, (hq + 2 * hkv) * d)
        pos = torch.randint(0, 300, (t,), generator=g).to(device)
        slots = torch.randperm(7 * 16, generator=g)[:t].to(device)  # distinct cache slots
        cos, sin = rope.cos.to(device), rope.sin.to(device)
        for wq, wk in ((rand(d), rand(d)), (None, None)):
            kc, vc = rand(7, 16, hkv, d), rand(7, 16, hkv, d)  # random (poisoned) cache contents
            caches = [(kc.clone(), vc.clone()), (kc.clone(), vc.clone())]  # (ours, reference)
            q = F.qkv_rope_store(qkv, hq, hkv, wq, wk, 1e-6, cos, sin, pos, *caches[0], slots)
            rq = F.qkv_rope_store_ref(qkv, hq, hkv, wq, wk, 1e-6, cos, sin, pos, *caches[1], slots)
            what = f"qkv_rope_store(norm={wq is not None}, T={t})"
            close(q, rq, what + " q")
            close(caches[0][0], caches[1][0], what + " k cache")
            assert torch.equal(caches[0][1], caches[1][1]), what + " v cache (a copy: exact)"
    for t, e, k, renorm in ((1, 128, 8, True), (9, 10, 3, True), (17, 60, 4, False), (3, 6, 6, True)):
        logits = rand(t, e)
        w, ids = F.topk_softmax(logits, k, renorm)
        rw, rids = F.topk_softmax_ref(logits, k, renorm)
        assert torch.equal(ids.cpu().sort(-1).values, rids.cpu().sort(-1).values), "topk ids"
        close(w.sort(-1).values, rw.sort(-1).values, "topk weights")
        assert ids.dtype == torch.int32 and w.dtype == torch.float32
    check_topk_non_finite(device, dtype)


def check_topk_non_finite(device: str, dtype: torch.dtype) -> None:
    """A row whose router logits hold NaN or +inf (its hidden state blew up) still gets K distinct expert ids in
    [0, E) (the kernel returned E, read past the GPU experts' weights) and NaN weights (its request then fails
    alone at sampling), as the reference does; -inf logits are ordinary; the other rows are unchanged."""
    from hybridmoe.layers import fused_ops as F

    g = torch.Generator().manual_seed(2)
    for e, k in ((128, 8), (10, 3), (6, 6), (60, 4)):
        logits = torch.randn(5, e, generator=g)
        clean = {fn: fn(logits.to(device, dtype), k, True) for fn in (F.topk_softmax, F.topk_softmax_ref)}
        logits[1] = float("nan")
        logits[2, e // 2] = float("nan")
        logits[3, 0] = float("inf")
        logits[4, : e // 2] = float("-inf")
        for fn in (F.topk_softmax, F.topk_softmax_ref):
            w, ids = (v.cpu() for v in fn(logits.to(device, dtype), k, True))
            what = f"{fn.__name__} E={e} K={k} {dtype}"
            assert bool(((ids >= 0) & (ids < e)).all()), f"{what}: ids {ids.tolist()}"
            assert all(len(set(r)) == k for r in ids.tolist()), f"{what}: repeated ids {ids.tolist()}"
            assert bool(w[1:4].isnan().all()) and bool(w[4].isfinite().all()), f"{what}: {w}"
            assert torch.equal(ids[0], clean[fn][1][0].cpu()) and torch.equal(w[0], clean[fn][0][0].cpu()), what


def test_interpreter_fp32():
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = "import interpreter, torch, test_fused_ops as t; t.check('cpu', torch.float32, 1e-5); t.check('cpu', torch.float16, 2e-3)"
    res = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_cuda(dtype, tol):
    check("cuda", dtype, tol)


_MODEL_CHILD = """
import sys, torch
import interpreter  # its faster nested calls under the interpreter
from hybridmoe import LLM
from hybridmoe.layers import fused_ops
ref = torch.load(sys.argv[2])
# first the fused q/k/v kernel, then as on a machine that cannot build it (the separate kernels)
for broken in (False, True):
    fused_ops._qkv_fused_failed = broken
    for kind, (prompt, logits, tokens) in ref.items():
        llm = LLM(sys.argv[1] + "/" + kind, device="cpu", progress=False)
        got = llm.prompt_logits(prompt)
        err = ((got - logits).norm() / logits.norm()).item()
        assert err < 1e-5, f"{kind} (fused q/k/v broken: {broken}): prompt logits differ: {err:.2e}"
        out = llm.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 6,
                                                              "ignore_eos": True})
        assert out["output_ids"] == tokens, f"{kind} (fused q/k/v broken: {broken}): greedy tokens differ"
        llm.shutdown()
print("ok")
"""


@pytest.mark.slow
def test_model_with_fused_kernels_interpreted(tmp_path):
    """The whole model with the fused kernels (q/k/v norm + RoPE + KV store in one launch, fused
    norms and routing) under the Triton interpreter gives the torch path's logits and tokens."""
    sys.path.insert(0, os.path.dirname(__file__))
    from hybridmoe import LLM

    from tiny_models import make_tiny_model

    ref = {}
    for kind in ("qwen3_moe", "mixtral"):  # with and without q/k norm
        path = make_tiny_model(kind, tmp_path / kind)
        llm = LLM(str(path), device="cpu", progress=False)
        prompt = torch.randint(0, 200, (21,), generator=torch.Generator().manual_seed(1)).tolist()
        out = llm.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 6,
                                                              "ignore_eos": True})
        ref[kind] = (prompt, llm.prompt_logits(prompt), out["output_ids"])
        llm.shutdown()
    torch.save(ref, tmp_path / "ref.pt")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", _MODEL_CHILD, str(tmp_path), str(tmp_path / "ref.pt")],
                         cwd=os.path.dirname(__file__), env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


def test_qkv_fused_kernel_failure_falls_back(monkeypatch, caplog):
    """If the fused q/k/v kernel cannot be built here, the dispatcher says so once, does not try
    again, and returns None so that the layer runs the separate Triton kernels."""
    pytest.importorskip("triton")
    from hybridmoe.layers import fused_ops as F
    from hybridmoe.layers.rotary import RotaryEmbedding

    class Broken:
        calls = 0

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                Broken.calls += 1
                raise RuntimeError("no compiler for this")

            return launch

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # use_triton() says yes on CPU tensors
    monkeypatch.setattr(F, "_qkv_rope_store_kernel", Broken(), raising=False)
    monkeypatch.setattr(F, "_qkv_fused_failed", False)
    rope = RotaryEmbedding(16, 64, 10000.0)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, (4 + 2 * 2) * 16, generator=g)
    pos, slots = torch.tensor([1, 5, 9]), torch.tensor([3, 0, 7])
    caches = [(torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)) for _ in range(2)]
    for _ in range(2):  # None: the caller runs the separate kernels (the model test above covers that path)
        assert F.qkv_rope_store(qkv, 4, 2, None, None, 1e-6, rope.cos, rope.sin, pos, *caches[0], slots) is None
    assert Broken.calls == 1 and F._qkv_fused_failed
    assert sum("fused q/k/v" in r.message for r in caplog.records) == 1
