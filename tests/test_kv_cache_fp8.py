"""`--kv-cache-dtype fp8_e4m3|fp8_e5m2`: K/V stored as unscaled FP8, upcast inside the attention kernels.

Legend: T new tokens, Hq/Hkv heads, D head dim, N pages, S page size.

Checked, for both FP8 formats:
- the store (store_kv, and the fused q/k/v + RoPE + store kernel: on the GPU, see INTERPRETED) writes
  exactly torch's saturating conversion of the values (bytes compared), T=0 included;
- the Triton kernels (interpreter on the CPU, a subprocess as in test_triton_attention.py) and the torch
  backend attend over the FP8 cache like a fp64 reference over the same FP8 values: 2e-2 relative (the
  bf16 tolerance of test_triton_attention.py: q and the probabilities are bf16 in the kernels);
- against attention over the unquantized K/V, the FP8 cache's error is bounded by the format's
  precision: e4m3 (3 mantissa bits) 0.08, e5m2 (2 bits) 0.15 relative to the largest output; measured
  up to 0.056 and 0.105 on these unit-variance K/V (unscaled FP8: no per-tensor scale to use the range).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from interpreter import assert_interpreted, report, script_main
from test_triton_attention import DECODE_CASES, PREFILL_CASES, gather_sequence, make_inputs, reference_attention

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
TOL_SAME_VALUES = 2e-2
TOL_VS_UNQUANTIZED = {"e4m3": 0.08, "e5m2": 0.15}
# The Triton interpreter converts to FP8 with a wrong rounding (a carry out of the mantissa does not
# reach the exponent: bf16 7.97 -> e4m3 4.0); loads (FP8 -> wider) are right. The fused store kernel's
# FP8 codes are therefore compared on the GPU only (test_fp8_kv_gpu); on the CPU its torch reference runs.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CASES = [DECODE_CASES[0], DECODE_CASES[1], DECODE_CASES[3], PREFILL_CASES[0], PREFILL_CASES[2], PREFILL_CASES[3]]


def saturating(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    return x.float().clamp(-limit, limit).to(dtype)


def fp8_inputs(case: tuple, fmt: str, device: str, seed: int) -> dict:
    """make_inputs in bf16, its caches converted to FP8 (the prefixes as the server would have stored them)."""
    _, seqs, hq, hkv, d, page, splits, extra = case
    x = make_inputs(seqs, hq, hkv, d, page, torch.bfloat16, device, extra, seed)
    x["k_cache"] = saturating(x["k_cache"], FP8[fmt])
    x["v_cache"] = saturating(x["v_cache"], FP8[fmt])
    return x


def attention_errors(backend_name: str, case: tuple, fmt: str, device: str, seed: int) -> tuple[float, float]:
    """(error vs fp64 attention over the same FP8 values, error vs attention over the unquantized K/V)."""
    from hybridmoe.layers.attention.base import get_attention_backend

    x = fp8_inputs(case, fmt, device, seed)
    meta = x["meta"]
    backend = get_attention_backend(backend_name)
    if backend_name == "triton":
        backend.num_kv_splits = case[6]
    out = backend.forward(x["q"], x["k"], x["v"], x["k_cache"], x["v_cache"], meta, x["scale"]).cpu().double()
    assert out.dtype == torch.float64 and torch.isfinite(out).all(), case[0]
    for b, seq_len in enumerate(meta.seq_lens_cpu):  # the new tokens were stored as FP8 too
        kg, vg = gather_sequence(x["k_cache"], x["v_cache"], meta.block_table[b].cpu(), seq_len)
        assert torch.equal(kg.view(torch.uint8), saturating(x["k_full"][b].cpu(), FP8[fmt]).view(torch.uint8))
        assert torch.equal(vg.view(torch.uint8), saturating(x["v_full"][b].cpu(), FP8[fmt]).view(torch.uint8))
    ref_fp8 = reference_attention(x["q"], x["k_cache"], x["v_cache"], meta)
    # the same attention over unquantized (bf16) K/V: every token of every sequence rewritten in bf16
    k_hi = torch.zeros(x["k_cache"].shape, dtype=torch.bfloat16)
    v_hi = torch.zeros(x["v_cache"].shape, dtype=torch.bfloat16)
    page = k_hi.shape[1]
    for b, seq_len in enumerate(meta.seq_lens_cpu):
        pos = torch.arange(seq_len)
        pages = meta.block_table[b].cpu().long()[pos // page]
        k_hi[pages, pos % page] = x["k_full"][b].cpu()
        v_hi[pages, pos % page] = x["v_full"][b].cpu()
    ref_hi = reference_attention(x["q"], k_hi, v_hi, meta)
    return (((out - ref_fp8).abs().max() / ref_fp8.abs().max()).item(),
            ((out - ref_hi).abs().max() / ref_hi.abs().max()).item())


def run_attention(backend_name: str, device: str) -> list[str]:
    failures: list[str] = []
    for fmt in FP8:
        for case in CASES:
            for seed in (0, 1):
                tag = f"{backend_name} {fmt} {case[0]} seed={seed}"
                try:
                    same, hi = attention_errors(backend_name, case, fmt, device, seed)
                    ok = same <= TOL_SAME_VALUES and hi <= TOL_VS_UNQUANTIZED[fmt]
                    msg = f"{tag}: rel err {same:.2e} vs the FP8 values, {hi:.2e} vs unquantized"
                except Exception as e:
                    ok, msg = False, f"{tag}: {type(e).__name__}: {e}"
                report(ok, msg, failures)
    return failures


def fused_store(fmt: str, t: int, device: str, seed: int = 0) -> None:
    """qkv_rope_store (the Triton kernel where it runs, else the reference) writes the codes the reference does."""
    from hybridmoe.layers.fused_ops import qkv_rope_store, qkv_rope_store_ref

    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, n, s = 4, 2, 32, 5, 4
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(torch.bfloat16).to(device)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16).to(device)
    ang = torch.rand(64, d // 2, generator=g)
    cos, sin = ang.cos().to(device), ang.sin().to(device)
    pos = torch.randint(0, 64, (t,), generator=g).to(device)
    slots = torch.randperm(n * s, generator=g)[:t].to(device)
    caches = []
    for fn in (qkv_rope_store, qkv_rope_store_ref):
        kc = torch.zeros(n, s, hkv, d, dtype=FP8[fmt], device=device)
        vc = torch.zeros(n, s, hkv, d, dtype=FP8[fmt], device=device)
        q = fn(qkv, hq, hkv, w, w, 1e-6, cos, sin, pos, kc, vc, slots)
        assert q is not None and q.shape == (t, hq, d)
        caches.append((kc.view(torch.uint8).cpu(), vc.view(torch.uint8).cpu()))
    (k1, v1), (k2, v2) = caches
    assert torch.equal(v1, v2), "v codes differ"
    # k went through RoPE in bf16 in both; the FP8 codes may differ by one step where bf16 rounding of
    # the rotation differs (the kernel rotates in fp32, then rounds once)
    diff = (k1.view(FP8[fmt]).float() - k2.view(FP8[fmt]).float()).abs()
    step = k2.view(FP8[fmt]).float().abs().clamp(min=2.0**-6) * (2.0 ** -(3 if fmt == "e4m3" else 2))
    assert (diff <= step + 1e-12).all(), f"k codes differ by more than one FP8 step: {diff.max()}"


def run_store(device: str) -> list[str]:
    from hybridmoe.layers.attention.base import store_kv

    failures: list[str] = []
    for fmt, dtype in FP8.items():
        for t in (0, 1, 7):
            try:
                g = torch.Generator().manual_seed(t)
                k = torch.randn(t, 2, 8, generator=g) * 100  # beyond e4m3's 448 saturates, not inf/NaN
                if t:
                    k[0, 0, 0] = 1e6
                v = torch.randn(t, 2, 8, generator=g)
                kc = torch.zeros(3, 4, 2, 8, dtype=dtype, device=device)
                vc = torch.zeros(3, 4, 2, 8, dtype=dtype, device=device)
                slots = torch.randperm(12, generator=g)[:t].to(device)
                store_kv(k.to(torch.bfloat16).to(device), v.to(torch.bfloat16).to(device), kc, vc, slots)
                got = kc.view(torch.uint8).view(12, 2, 8)[slots.cpu()].cpu()
                want = saturating(k.to(torch.bfloat16), dtype).view(torch.uint8)
                ok = torch.equal(got, want) and torch.isfinite(kc.float()).all().item()
                ok = ok and torch.equal(vc.view(torch.uint8).view(12, 2, 8)[slots.cpu()].cpu(),
                                        saturating(v.to(torch.bfloat16), dtype).view(torch.uint8))
                note = ""
                if INTERPRETED:
                    note = " (fused kernel not compared: the interpreter's FP8 downcast rounds wrongly, 7.97 -> 4.0)"
                else:
                    fused_store(fmt, t, device)
                report(ok, f"store {fmt} T={t}{note}", failures)
            except Exception as e:
                report(False, f"store {fmt} T={t}: {type(e).__name__}: {e}", failures)
    return failures


GROUPS = {"store": run_store, "triton": lambda dev: run_attention("triton", dev)}


def run_group(group: str, device: str) -> list[str]:
    return GROUPS[group](device)


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


@needs_triton
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_fp8_kv_interpreter(group: str) -> None:
    """The store (fused kernel included) and the Triton kernels over FP8 caches, under the interpreter."""
    assert_interpreted(__file__, group)


def test_fp8_kv_torch_backend() -> None:
    """The CPU torch backend over FP8 caches (the store without Triton: the reference path)."""
    assert run_attention("torch", "cpu") == []
    assert run_store("cpu") == []


@pytest.mark.parametrize("name,want", [("auto", torch.bfloat16), ("bf16", torch.bfloat16),
                                       ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_kv_cache_dtype_names(name: str, want: torch.dtype) -> None:
    from hybridmoe.layers.attention.base import kv_cache_dtype

    assert kv_cache_dtype(name, torch.bfloat16) == want
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        kv_cache_dtype("fp4", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_fp8_kv_gpu(group: str) -> None:
    """The same cases compiled for the GPU (e4m3 needs sm_89+)."""
    assert run_group(group, "cuda") == []


if __name__ == "__main__":
    script_main(GROUPS, run_group)
