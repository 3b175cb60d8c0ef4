"""The fused grouped router (moe/routing_triton.py) against routing.route_ref: under the Triton interpreter on
the CPU (a subprocess: the interpreter must be chosen before triton is imported), on CUDA when present, and an
sm_90 compile of every constexpr form."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch

# (E, n_group, topk_group, K): DeepSeek-V3 (256/8/4/8), V2 (160 experts in 8 groups of 20: not a power of two),
# Kimi-K2 (384, one group), odd sizes, one expert a group, K = E
SHAPES = [(256, 8, 4, 8), (160, 8, 3, 6), (384, 1, 1, 8), (24, 3, 2, 5), (7, 7, 3, 2), (12, 4, 4, 12), (9, 1, 1, 1)]
FORMS = [("sigmoid", "noaux_tc", True), ("sigmoid", "noaux_tc", False), ("softmax", "group_limited_greedy", False),
         ("sigmoid", "greedy", False), ("softmax", "greedy", False), ("softmax", "noaux_tc", True)]


def cases(every: int = 1, ts: tuple[int, int, int] = (1, 5, 33)) -> list[tuple]:
    """Every shape x form, with renormalize, scaling and T (from ts) taking turns (each value meets every shape and
    form across the two). `every` > 1 keeps one case in that many."""
    out = []
    for i, (shape, form) in enumerate(itertools.product(SHAPES, FORMS)):
        out.append((shape, form, i % 2 == 0, (1.0, 2.5)[(i // 2) % 2], ts[i % 3]))
    return out[::every]


def check(device: str, dtype: torch.dtype, every: int = 1) -> int:
    """The same expert set per token and the same weights as the reference, on every case. Logits of unit scale, as
    a router's are: much larger ones saturate the sigmoid into exact float32 ties, which either order may break."""
    from hybridmoe.moe.routing import RoutingConfig, route, route_ref

    g = torch.Generator().manual_seed(0)
    n = 0
    # one program a token: the interpreter (~10 ms a program) takes fewer tokens than CUDA
    ts = (1, 5, 33) if device == "cuda" else (1, 5, 9)
    for (e, ng, tg, k), (scoring, method, with_bias), renorm, scaling, t in cases(every, ts):
        cfg = RoutingConfig(top_k=k, scoring=scoring, method=method, renormalize=renorm, n_group=ng, topk_group=tg,
                            scaling=scaling)
        logits = torch.randn(t, e, generator=g).to(device, dtype)
        bias = (torch.randn(e, generator=g) * 0.1).to(device) if with_bias else None
        w, ids = route(logits, cfg, bias)
        rw, rids = route_ref(logits, cfg, bias)
        what = f"E={e} G={ng}/{tg} K={k} {scoring} {method} bias={with_bias} renorm={renorm} scale={scaling} T={t}"
        assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == (t, k), what
        order, rorder = ids.long().sort(-1), rids.long().sort(-1)
        assert torch.equal(order.values.cpu(), rorder.values.cpu()), f"{what}: expert sets differ"
        got = w.gather(1, order.indices).cpu()
        ref = rw.gather(1, rorder.indices).cpu()
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-7, msg=lambda m, what=what: f"{what}: {m}")
        n += 1
    return n


def check_non_finite(device: str) -> int:
    """A token whose router logits are NaN or infinite (its hidden state blew up) still gets K distinct expert ids
    in [0, E) (an id out of range read past the GPU experts' weights, or failed the CPU experts' whole task), and
    a NaN weight where its scores are NaN (its request then fails alone at sampling); the other tokens of the
    batch get what they get without it."""
    from hybridmoe.moe.routing import RoutingConfig, route

    g = torch.Generator().manual_seed(1)
    n = 0
    for (e, ng, tg, k), (scoring, method, with_bias) in itertools.product(SHAPES, FORMS):
        cfg = RoutingConfig(top_k=k, scoring=scoring, method=method, renormalize=True, n_group=ng, topk_group=tg,
                            scaling=1.0)
        logits = torch.randn(5, e, generator=g)
        bias = (torch.randn(e, generator=g) * 0.1).to(device) if with_bias else None
        clean_w, clean_ids = route(logits.to(device), cfg, bias)
        logits[1] = float("nan")
        logits[2, e // 2] = float("nan")
        logits[3, 0] = float("inf")
        logits[4, -1] = float("-inf")
        w, ids = route(logits.to(device), cfg, bias)
        what = f"E={e} G={ng}/{tg} K={k} {scoring} {method} bias={with_bias}"
        ids, w = ids.long().cpu(), w.cpu()
        assert bool(((ids >= 0) & (ids < e)).all()), f"{what}: ids {ids.tolist()}"
        assert all(len(set(r)) == k for r in ids.tolist()), f"{what}: repeated ids {ids.tolist()}"
        assert bool(w[1].isnan().all() and w[2].isnan().all()), f"{what}: {w[1:3]}"
        assert bool(w[3].isnan().all()) == (scoring == "softmax") and bool(w[4].isfinite().all()), f"{what}: {w[3:]}"
        assert torch.equal(ids[0], clean_ids[0].long().cpu()) and torch.equal(w[0], clean_w[0].cpu()), what
        n += 1
    return n


def test_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = ("import interpreter, torch, test_routing_triton as t; n = t.check('cpu', torch.float32); "
            "n += t.check('cpu', torch.bfloat16, every=3); n += t.check_non_finite('cpu'); print(n)")
    res = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert int(res.stdout.split()[-1]) == len(cases()) + len(cases(3)) + len(SHAPES) * len(FORMS)


def test_reference_non_finite():
    """The torch path (the CPU device's) keeps ids in range too."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter routes CPU tensors through the kernel")
    assert check_non_finite("cpu") == len(SHAPES) * len(FORMS)


def test_the_cpu_path_is_the_reference():
    """Without a GPU or the interpreter, route is route_ref (the CPU device's path) bit for bit."""
    from hybridmoe.moe.routing import RoutingConfig, route, route_ref

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter routes CPU tensors through the kernel")
    cfg = RoutingConfig(top_k=8, scoring="sigmoid", method="noaux_tc", renormalize=True, n_group=8, topk_group=4,
                        scaling=2.5)
    logits, bias = torch.randn(3, 256), torch.randn(256)
    for a, b in zip(route(logits, cfg, bias), route_ref(logits, cfg, bias)):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda(dtype):
    check("cuda", dtype)
    if dtype == torch.float32:
        check_non_finite("cuda")


@pytest.mark.parametrize("method", [0, 1, 2])
@pytest.mark.parametrize("sigmoid", [True, False])
def test_kernel_compiles_for_sm90(method, sigmoid):
    pytest.importorskip("triton")
    from test_triton_compile import compile_sm90

    from hybridmoe.moe.routing_triton import _grouped_topk_kernel

    types = dict(logits_ptr="*bf16", bias_ptr="*fp32", w_ptr="*fp32", ids_ptr="*i32", stride_t="i32",
                 n_experts="i32", per_group="i32", scaling="fp32")
    compile_sm90(_grouped_topk_kernel, types, dict(SIGMOID=sigmoid, METHOD=method, HAS_BIAS=method == 2, RENORM=True,
                                                  N_GROUP=8, TOPK_GROUP=4, K=8, BLOCK_E=256, BLOCK_G=8, BLOCK_K=8))
