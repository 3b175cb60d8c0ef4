"""The native dense BF16 linears (hybridmoe.cpu.dense, csrc/dense*.cpp) against the torch
definition, on every ISA path this CPU has, and their use in the CPU-only bf16 model
(hybridmoe.cpu.dense_linears).

Tolerance, justified: both sides sum the same exact fp32 products of bf16 values in fp32; only
the order differs, so fp32 outputs agree to a few fp32 ulps of the sum of |products|
(1e-5 relative to it is ~100 ulps: room for K up to a few thousand, and it still fails on any
wrong or missing term, which moves a result by ~1/K of that sum or more). bf16 outputs are the
same values rounded, so they may differ by one bf16 ulp where the fp32 sums straddle a rounding
boundary.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridmoe.cpu.dense import dense_isa, dense_linear, dense_linear_reference
from hybridmoe.cpu.dense_linears import DenseLinears


def _data(t: int, n: int, k: int, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


def _scale(x, w, b):
    """Per-output sum of |products| (+ |bias|): what the fp32 rounding error is relative to."""
    s = x.float().abs() @ w.float().abs().t()
    return s + (b.abs() if b is not None else 0) + 1e-30


def _check(y, x, w, b, out_dtype):
    ref = dense_linear_reference(x, w, b, out_dtype)
    assert y.shape == ref.shape and y.dtype == out_dtype
    if y.numel() == 0:
        return
    if out_dtype == torch.float32:
        err = ((y - ref).abs() / _scale(x, w, b)).max().item()
        assert err < 1e-5, err
    else:  # at most one bf16 ulp (2^-7 relative) apart, plus the fp32 slack
        tol = ref.float().abs() * 2**-7 + _scale(x, w, b) * 1e-5
        assert ((y.float() - ref.float()).abs() <= tol).all()


SIZES = [  # (T, N, K): odd N (row tails), K not a multiple of 32 / 8 (K tails), K < 8, more tokens than a tile
    (1, 37, 45), (1, 1, 1), (1, 5, 7), (2, 64, 2048), (3, 100, 33), (4, 19, 64), (5, 17, 100), (9, 33, 31),
    (1, 1000, 1100),  # over the inline size: the pool's chunked path
    (6, 700, 777),
]


@pytest.mark.parametrize("t,n,k", SIZES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_against_reference(isa, pool, t, n, k, out_dtype):
    if isa == "amx":
        assert dense_isa("amx") == "avx512"  # no AMX kernels of its own
    for bias in (False, True):
        x, w, b = _data(t, n, k, seed=t * 1000 + n + k, bias=bias)
        _check(dense_linear(x, w, b, out_dtype=out_dtype, pool=pool, isa=isa), x, w, b, out_dtype)


@pytest.mark.parametrize("t,n,k", [(1, 1000, 1100), (1, 37, 45), (3, 100, 33)])
def test_prefetch_changes_nothing_but_speed(isa, t, n, k):
    """Software prefetch on (a template path of its own in the one-token kernel) and off: bit-identical."""
    from hybridmoe.cpu.engine import CPUThreadPool
    from hybridmoe.cpu.settings import CPUEngineSettings

    x, w, b = _data(t, n, k, seed=n + k, bias=True)
    outs = []
    for pf in (0, 2048, 64):
        pool = CPUThreadPool(threads=2, settings=CPUEngineSettings(prefetch_bytes=pf))
        try:
            outs.append(dense_linear(x, w, b, out_dtype=torch.float32, pool=pool, isa=isa))
        finally:
            pool.close()
    _check(outs[0], x, w, b, torch.float32)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_zero_tokens_and_rows(isa, pool):
    x, w, _ = _data(0, 8, 16, 0, False)
    assert dense_linear(x, w, pool=pool, isa=isa).shape == (0, 8)
    x, w, _ = _data(3, 0, 16, 0, False)
    assert dense_linear(x, w, pool=pool, isa=isa).shape == (3, 0)


def test_strided_input_and_weight_rows_and_out(isa, pool):
    """x rows with a stride (a view into a wider buffer), weight rows with a stride, leading dims, out=."""
    g = torch.Generator().manual_seed(7)
    xb = torch.randn(2, 3, 90, generator=g).bfloat16()
    wb = torch.randn(50, 80, generator=g).bfloat16()
    x, w = xb[..., 5:75], wb[:, 3:73]
    out = torch.empty(2, 3, 50, dtype=torch.float32)
    y = dense_linear(x, w, out=out, pool=pool, isa=isa)
    assert y is out
    _check(y.reshape(6, 50), x.reshape(6, 70), w, None, torch.float32)


def test_rejects_bad_arguments(pool):
    x, w, _ = _data(2, 4, 8, 0, False)
    with pytest.raises(ValueError, match="bf16"):
        dense_linear(x.float(), w, pool=pool)
    with pytest.raises(ValueError, match="weight must be"):
        dense_linear(x, w[:, :4], pool=pool)
    with pytest.raises(ValueError, match="bias"):
        dense_linear(x, w, torch.zeros(5), pool=pool)
    with pytest.raises(ValueError, match="out must be"):
        dense_linear(x, w, out=torch.empty(2, 5), pool=pool)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(48, 70, bias=True)
        self.b = nn.Linear(70, 33, bias=False)
        self.f32 = nn.Linear(33, 9)  # stays float32: never patched

    def forward(self, x):
        return self.f32(self.b(self.a(x)).float())


def test_installed_forwards_match_torch_and_fall_back(isa, pool):
    torch.manual_seed(0)
    m = _Tiny()
    m.a.bfloat16()
    m.b.bfloat16()
    x = torch.randn(3, 48).bfloat16()
    with torch.no_grad():
        ref_a = dense_linear_reference(x, m.a.weight, m.a.bias)
        torch_out = m(x)
        dl = DenseLinears(m, pool, isa=isa, max_tokens=3)
        assert set(dl.modules) == {"a", "b"}
        y = m.a(x)
        assert (y.float() - ref_a.float()).abs().max() <= ref_a.float().abs().max() * 2**-7
        assert torch.allclose(m(x), torch_out, rtol=3e-2, atol=3e-2)
        big = torch.randn(4, 48).bfloat16()  # over max_tokens: torch's own GEMM, bit for bit
        assert torch.equal(m.a(big), nn.functional.linear(big, m.a.weight, m.a.bias))
        dl.enabled = False
        assert torch.equal(m.a(x), nn.functional.linear(x, m.a.weight, m.a.bias))
        dl.remove()
        assert "forward" not in vars(m.a)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])  # qwen2: qkv bias, shared experts + gate, tied head
def test_cpu_only_bf16_model_greedy_unchanged(tmp_path, kind):
    """CPU-only bf16 (every expert on the engine): the dense linears are installed on the attention,
    dense-MLP, shared-expert and LM-head linears, the native decode attention on every layer, and
    greedy decoding gives the torch path's tokens."""
    from hybridmoe import LLM

    from tiny_models import make_tiny_model

    path = make_tiny_model(kind, tmp_path / kind)
    llm = LLM(str(path), device="cpu", dtype="bfloat16", progress=False, kt_num_gpu_experts=0, kt_method="BF16")
    dl = llm.engine.runner.dense_linears
    assert dl is not None and dl.enabled
    names = set(dl.modules)
    assert "lm_head" in names and any(n.endswith("qkv_proj") for n in names) and any(n.endswith("o_proj") for n in names)
    prompt = torch.randint(0, 150, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    calls = []
    lm = dl.modules["lm_head"]
    native_fwd = lm.forward
    lm.forward = lambda x: calls.append(x.shape[0]) or native_fwd(x)
    ours = llm.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    assert 1 in calls  # decode steps went through the native forward
    lm.forward = native_fwd
    ad = llm.engine.runner.attn_decode  # the native decode attention (test_attn_decode.py) as well
    assert ad is not None and ad.native_calls > 0
    dl.enabled = ad.enabled = False
    ref = llm.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    assert ours == ref
    llm.shutdown()


@pytest.mark.parametrize("n", [1, 7, 8, 9, 33, 1000, 151936])
def test_argmax_rows_is_torch_argmax(n):
    """Greedy sampling's native argmax: torch.argmax's index exactly, including ties (first), NaN
    (first NaN wins), -0 == +0, all -inf, and rows with a stride (a vocabulary slice)."""
    from hybridmoe.cpu.dense import argmax_rows

    g = torch.Generator().manual_seed(n)
    for case in range(6):
        x = torch.randn(3, n + 5, generator=g).bfloat16()[:, :n]
        if case == 1:
            x[1, torch.randint(0, n, (2,), generator=g)] = float("nan")
        elif case == 2:
            x.zero_()
            x[0, n // 2] = -0.0
            x[1, -1] = -0.0
        elif case == 3:
            x[2] = float("-inf")
        elif case == 4:
            x[0, :] = x[0].max()
        elif case == 5:
            x[1, -1] = float("inf")
        assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1)), case
        # the sampler's mark: rows holding NaN or +inf (in any column, up to the last) get it, others the index
        marked = argmax_rows(x, -77)
        bad = ~(x.float() < float("inf")).all(dim=-1)
        assert torch.equal(marked, torch.where(bad, -77, torch.argmax(x, dim=-1))), case
        assert bool(bad.any()) == (case in (1, 5)), case
    assert argmax_rows(torch.zeros(2, 4)) is None  # not bf16: the caller uses torch
