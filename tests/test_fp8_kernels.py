"""The Triton block-FP8 kernels (layers/fp8_kernels.py) against their torch references.

Legend: M tokens, K input features, N output features, bn x bk the weight block.

CPU/CI: the kernels run under the Triton interpreter in ONE subprocess with TRITON_INTERPRET=1 set
before triton is imported (the interpreter handles float8: loads, stores, tl.dot of e4m3 operands;
its own fp32 -> fp8 rounding is wrong, which the kernels avoid, see the module docstring).

Tolerances, and why:
- per-token-group quantization: EXACT (codes and scales) against the torch reference, on the
  interpreter and on the GPU: the same fp32 division and round-half-to-even.
- the GEMM against `w8a8_block_gemm_ref` (x quantized the same way, both dequantized, one fp32
  matmul): fp32 output, max abs error / max |ref| <= 1e-5 on the interpreter (fp32 summation order
  only); on the GPU <= 2e-3, because Hopper's fp8 tensor cores accumulate a K-block's products with
  fewer than fp32's mantissa bits (DeepSeek-V3 report, sec. 3.3.2; ~2^-13 of a block's partial sum)
  before the kernel adds it to its fp32 accumulator; a bf16 output adds its own rounding (2^-9).
- against the matmul with the dequantized weight and the unquantized x (what a bf16 model
  computes): loose, rms relative error <= 5%: e4m3 rounds each activation by up to 2^-4 of its
  value (~2.5% rms over a group), which a dot product averages but does not remove.
GPU (`-m gpu`): the same on CUDA at DeepSeek-V3 shapes (block 128 x 128), Fp8Linear against the
dequantized matmul, and CUDA-graph capture.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import zlib

import pytest
import torch

from hybridmoe.layers.fp8_kernels import (
    E4M3_MAX,
    HAVE_TRITON,
    dequant_groups,
    per_token_group_quant_ref,
    w8a8_block_gemm_ref,
)
from hybridmoe.weights.fp8 import block_dequant, block_quant

from interpreter import case_result, collect, json_results

TIGHT_INTERP = 1e-5
TIGHT_GPU = 2e-3
LOOSE_RMS = 0.05


def mixed_input(m: int, k: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Rows of very different magnitudes, a zero group and tiny values (e4m3 subnormals after scaling)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 2, m)[:, None]
    if m > 2 and k > 40:
        x[1, :32] = 0.0  # an all-zero group
        x[2, 5] = 1e3  # one outlier: the rest of its group lands in the subnormal range
    return x.to(dtype)


def rel_max(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def make_weight(n: int, k: int, block: tuple[int, int], seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    w = torch.randn(n, k, generator=g) / k**0.5
    return block_quant(w, block)


# (M, K, group, dtype, strided)
QUANT_CASES = {
    "m1_k75_g32": (1, 75, 32, "float32", False),
    "m7_k200_g32": (7, 200, 32, "float32", False),
    "m300_k100_g16": (300, 100, 16, "float32", False),
    "m5_k300_g128_bf16": (5, 300, 128, "bfloat16", False),
    "m9_k64_g32_strided": (9, 64, 32, "float32", True),
    "m0_k64_g32": (0, 64, 32, "float32", False),
}
# (M, N, K, bn, bk, x dtype, out dtype)
GEMM_CASES = {
    "m1_n37_k75_b16x32": (1, 37, 75, 16, 32, "float32", "float32"),
    "m300_n50_k100_b16x32": (300, 50, 100, 16, 32, "float32", "float32"),
    "m5_n130_k64_b128x64": (5, 130, 64, 128, 64, "float32", "float32"),
    "m33_n81_k200_b24x16": (33, 81, 200, 24, 16, "float32", "float32"),  # bn not a power of two
    "m3_n40_k96_bf16": (3, 40, 96, 16, 32, "bfloat16", "float32"),
    "m0_n40_k96": (0, 40, 96, 16, 32, "float32", "float32"),
    # split-K (the small-M path on the GPU): uneven ranges, a bf16 input,
    # and more splits asked than there are K groups
    "m1_n37_k200_b16x16_split3": (1, 37, 200, 16, 16, "float32", "float32"),
    "m4_n70_k300_split5_bf16in": (4, 70, 300, 16, 32, "bfloat16", "float32"),
    "m2_n20_k64_split9": (2, 20, 64, 16, 32, "float32", "float32"),
}
SPLIT_K = {"m1_n37_k200_b16x16_split3": 3, "m4_n70_k300_split5_bf16in": 5, "m2_n20_k64_split9": 9}


def _quant_case(name: str) -> dict:
    from hybridmoe.layers.fp8_kernels import per_token_group_quant

    m, k, group, dname, strided = QUANT_CASES[name]
    x = mixed_input(m, k, zlib.crc32(name.encode()) % 1000, getattr(torch, dname))
    if strided:
        x = torch.cat([x, x], dim=1)[:, :k]
    q, s = per_token_group_quant(x, group)
    qr, sr = per_token_group_quant_ref(x, group)
    return {"mismatch_q": int((q.view(torch.uint8) != qr.view(torch.uint8)).sum()),
            "mismatch_s": int((s != sr).sum()), "shape_ok": q.shape == (m, k) and s.shape == sr.shape}


def _gemm_case(name: str) -> dict:
    from hybridmoe.layers.fp8_kernels import w8a8_block_gemm

    m, n, k, bn, bk, xd, od = GEMM_CASES[name]
    x = mixed_input(m, k, 7, getattr(torch, xd)) if m else torch.empty(0, k)
    wq, ws = make_weight(n, k, (bn, bk), 3)
    y = w8a8_block_gemm(x, wq, ws, (bn, bk), out_dtype=getattr(torch, od), split_k=SPLIT_K.get(name))
    ref = w8a8_block_gemm_ref(x, wq, ws, (bn, bk), out_dtype=torch.float32)
    dense = x.float() @ block_dequant(wq, ws, (bn, bk)).T
    ok = tuple(y.shape) == (m, n) and y.dtype == getattr(torch, od)
    if m == 0:
        return {"tight": 0.0, "loose": 0.0, "shape_ok": ok}
    return {"tight": rel_max(y, ref), "loose": rel_rms(y, dense), "shape_ok": ok}


def _fp8_linear_case() -> dict:
    """Fp8Linear's forward on CPU tensors under the interpreter runs the reference; call the kernel
    through it by hand with a bias and a 3-D input."""
    from hybridmoe.layers.fp8_kernels import w8a8_block_gemm

    wq, ws = make_weight(37, 75, (16, 32), 5)
    x = mixed_input(6, 75, 9).view(2, 3, 75)
    y = w8a8_block_gemm(x.view(-1, 75), wq, ws, (16, 32)).view(2, 3, 37)
    ref = w8a8_block_gemm_ref(x.view(-1, 75), wq, ws, (16, 32)).view(2, 3, 37)
    return {"tight": rel_max(y, ref), "loose": 0.0, "shape_ok": y.shape == (2, 3, 37)}


def fp8_experts(e: int, i: int, h: int, block: tuple[int, int], seed: int):
    """Random experts in the ExpertWeights fp8 form (gate and up blocked separately, as in a checkpoint)."""
    from hybridmoe.moe.experts import ExpertWeights

    g = torch.Generator().manual_seed(seed)
    nbi = -(-i // block[0])
    gate_up = torch.empty(e, 2 * i, h, dtype=torch.float8_e4m3fn)
    down = torch.empty(e, h, i, dtype=torch.float8_e4m3fn)
    gu_s = torch.empty(e, 2 * nbi, -(-h // block[1]))
    d_s = torch.empty(e, -(-h // block[0]), -(-i // block[1]))
    for x in range(e):
        for rows, srows, std in ((slice(0, i), slice(0, nbi), 1.0), (slice(i, 2 * i), slice(nbi, 2 * nbi), 3.0)):
            q, sc = block_quant(torch.randn(i, h, generator=g) * std / h**0.5, block)
            gate_up[x, rows], gu_s[x, srows] = q, sc
        q, sc = block_quant(torch.randn(h, i, generator=g) / i**0.5, block)
        down[x], d_s[x] = q, sc
    return ExpertWeights(gate_up=gate_up, down=down, gate_up_scale=gu_s, down_scale=d_s, block=block)


# (T, E, K, H, I, bn, bk, dtype, extra): fused MoE with fp8 experts
MOE_CASES = {
    "t1_e4_k2_b16x32": (1, 4, 2, 72, 40, 16, 32, "float32", ""),
    "t33_e8_k3_b16x16": (33, 8, 3, 80, 48, 16, 16, "float32", ""),
    "t300_e8_k4_b32x64": (300, 8, 4, 72, 40, 32, 64, "float32", ""),
    "t5_e6_k2_b128x128": (5, 6, 2, 72, 40, 128, 128, "float32", ""),  # one block covers everything
    "t17_e8_k4_fp16": (17, 8, 4, 72, 40, 16, 32, "float16", ""),
    "t9_e8_k3_backend": (9, 8, 3, 72, 40, 16, 32, "float32", "backend"),
    "t0_backend": (0, 4, 2, 72, 40, 16, 32, "float32", "backend"),
}
MOE_TOL = {"float32": 1e-5, "float16": 2e-2}  # vs the fused kernel on the dequantized weights / loop reference


def _moe_case(name: str) -> dict:
    """fp8 experts through the fused kernels against (a) the same kernels on ExpertWeights.dequantized
    (the same weight values: only fp32 rounding differs) and (b) the loop reference of test_triton_moe."""
    from test_triton_moe import reference_moe, rel_err

    from hybridmoe.moe.experts import create_experts
    from hybridmoe.moe.triton_moe_kernels import fused_moe

    t, e, k, h, i, bn, bk, dname, extra = MOE_CASES[name]
    dtype = getattr(torch, dname)
    w = fp8_experts(e, i, h, (bn, bk), zlib.crc32(name.encode()) % 1000)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, h, generator=g).to(dtype)
    ids = torch.rand(t, e, generator=g).topk(k, dim=1).indices
    tw = torch.softmax(torch.randn(t, k, generator=g), dim=1)
    d = w.dequantized(dtype)
    if extra == "backend":
        import hybridmoe.moe  # noqa: F401  (registers the backends)

        backend = create_experts("triton", w, 0)
        out = backend.forward(x, ids, tw)
        kept = backend.gate_up.dtype == torch.float8_e4m3fn
    else:
        out = fused_moe(x, w.gate_up, w.down, ids, tw, gate_up_scale=w.gate_up_scale, down_scale=w.down_scale,
                        block=w.block)
        kept = True
    ok = tuple(out.shape) == (t, h) and out.dtype == dtype and kept
    if t == 0:
        return {"vs_dequant": 0.0, "vs_ref": 0.0, "tol": 0.0, "shape_ok": ok}
    same = fused_moe(x, d.gate_up, d.down, ids, tw)
    ref = reference_moe(x, d.gate_up, d.down, ids, tw)
    return {"vs_dequant": rel_err(out, same), "vs_ref": rel_err(out, ref), "tol": MOE_TOL[dname], "shape_ok": ok}


@pytest.fixture(scope="module")
def interp_results() -> dict:
    """All interpreter cases, run once in a subprocess with TRITON_INTERPRET=1."""
    return json_results(__file__)


@pytest.mark.parametrize("name", list(QUANT_CASES))
def test_interpreter_group_quant_exact(interp_results, name):
    res = case_result(interp_results, f"quant:{name}")
    assert res["shape_ok"] and res["mismatch_q"] == 0 and res["mismatch_s"] == 0, res


@pytest.mark.parametrize("name", [*GEMM_CASES, "fp8_linear_3d"])
def test_interpreter_gemm(interp_results, name):
    res = case_result(interp_results, f"gemm:{name}")
    assert res["shape_ok"], res
    assert res["tight"] <= TIGHT_INTERP, res
    assert res["loose"] <= LOOSE_RMS, res


@pytest.mark.parametrize("name", list(MOE_CASES))
def test_interpreter_fused_moe_fp8(interp_results, name):
    res = case_result(interp_results, f"moe:{name}")
    assert res["shape_ok"], res
    assert res["vs_dequant"] <= res["tol"] and res["vs_ref"] <= res["tol"], res


def test_triton_experts_dequantize_where_fp8_does_not_run():
    """Outside the interpreter on the CPU the fp8 path is off: the backend holds dequantized weights."""
    from hybridmoe.moe.options import ExpertsOptions
    from hybridmoe.moe.triton_experts import TritonExperts, fp8_experts_supported

    w = fp8_experts(3, 40, 72, (16, 32), 0)
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("runs outside the interpreter")
    assert not fp8_experts_supported(w)
    b = TritonExperts(w, 0, ExpertsOptions(dtype=torch.float16))
    assert b.gate_up.dtype == torch.float16 and torch.equal(b.down, w.dequantized(torch.float16).down)


def test_reference_quant_properties():
    """The reference itself: scale = group amax / 448, codes within e4m3's relative rounding."""
    x = mixed_input(9, 100, 1)
    q, s = per_token_group_quant_ref(x, 32)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (9, 4)
    amax = torch.nn.functional.pad(x.abs(), (0, 28)).view(9, 4, 32).amax(-1)
    assert torch.allclose(s, amax.clamp(min=1e-10) / E4M3_MAX)
    back = dequant_groups(q, s, 32)
    s_full = s.repeat_interleave(32, 1)[:, :100]
    # normals: half an ulp of 3 mantissa bits (2^-4 relative); subnormals: half of 2^-9 * scale
    assert ((back - x).abs() <= torch.maximum(x.abs() * 2**-4, s_full * 2**-10) * 1.0001).all()
    assert (q[1, :32].float() == 0).all()  # the zero group


def test_reference_gemm_matches_dense_loosely():
    wq, ws = make_weight(40, 96, (16, 32), 2)
    x = torch.randn(11, 96)
    y = w8a8_block_gemm_ref(x, wq, ws, (16, 32))
    assert rel_rms(y, x @ block_dequant(wq, ws, (16, 32)).T) <= LOOSE_RMS


# ---------------------------------------------------------------- GPU
def _needs_fp8_gpu():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMM needs sm_89+")


@pytest.mark.gpu
@pytest.mark.parametrize("m, k", [(1, 7168), (300, 7168), (33, 1000)])
def test_gpu_group_quant_exact(m, k):
    from hybridmoe.layers.fp8_kernels import per_token_group_quant

    _needs_fp8_gpu()
    x = mixed_input(m, k, 3, torch.bfloat16).cuda()
    q, s = per_token_group_quant(x, 128)
    qr, sr = per_token_group_quant_ref(x, 128)
    # equal values; the sign of a zero code may differ (seen on the H200: the hardware cast gives +0
    # where the reference's gives -0 for tiny negative inputs), which the GEMM cannot tell apart
    assert torch.equal(q.float(), qr.float()) and torch.equal(s, sr)
    nonzero = qr.float() != 0
    assert torch.equal(q.view(torch.uint8)[nonzero], qr.view(torch.uint8)[nonzero])


# DeepSeek-V3 shapes (q_a_proj 7168 -> 1536, kv_a 7168 -> 576, o_proj 16384 -> 7168) and odd ones
GPU_GEMM = [(1, 1536, 7168, 128, 128), (300, 576, 7168, 128, 128), (64, 7168, 16384, 128, 128),
            (1, 37, 75, 16, 32), (300, 50, 100, 16, 32), (4096, 1536, 7168, 128, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, bn, bk", GPU_GEMM)
def test_gpu_gemm_vs_reference_and_dense(m, n, k, bn, bk):
    from hybridmoe.layers.fp8_kernels import w8a8_block_gemm

    _needs_fp8_gpu()
    wq, ws = (t.cuda() for t in make_weight(n, k, (bn, bk), 4))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16).cuda()
    ref = w8a8_block_gemm_ref(x, wq, ws, (bn, bk), out_dtype=torch.float32)
    y32 = w8a8_block_gemm(x, wq, ws, (bn, bk), out_dtype=torch.float32)
    assert rel_max(y32, ref) <= TIGHT_GPU
    y = w8a8_block_gemm(x, wq, ws, (bn, bk))
    assert y.dtype == torch.bfloat16 and rel_max(y, ref) <= TIGHT_GPU + 2**-9
    for split in (1, 3):  # the small-M default splits K: one range and three give the same product
        assert rel_max(w8a8_block_gemm(x, wq, ws, (bn, bk), out_dtype=torch.float32, split_k=split), ref) <= TIGHT_GPU
    dense = x @ block_dequant(wq, ws, (bn, bk)).to(torch.bfloat16).T  # what the bf16 model computes
    assert rel_rms(y, dense) <= LOOSE_RMS


@pytest.mark.gpu
def test_gpu_fp8_linear_vs_dequantized_matmul():
    """Fp8Linear (bias, 3-D input, bf16) against x @ dequant(W)^T + b in bf16 (loose), and against the
    reference with the same activation quantization (tight)."""
    from hybridmoe.layers.fp8_linear import Fp8Linear

    _needs_fp8_gpu()
    block = (128, 128)
    wq, ws = make_weight(2112, 7168, block, 6)
    lin = Fp8Linear(7168, 2112, block, bias=True, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        lin.weight.copy_(wq)
        lin.weight_scale_inv.copy_(ws)
        lin.bias.copy_(torch.randn(2112))
    x = torch.randn(3, 5, 7168, device="cuda", dtype=torch.bfloat16)
    y = lin(x)
    assert y.shape == (3, 5, 2112) and y.dtype == torch.bfloat16
    w_deq = block_dequant(wq.cuda(), ws.cuda(), block)
    dense = (x.view(-1, 7168) @ w_deq.to(torch.bfloat16).T + lin.bias).view(3, 5, 2112)
    assert rel_rms(y, dense) <= LOOSE_RMS
    ref = (w8a8_block_gemm_ref(x.view(-1, 7168), lin.weight, lin.weight_scale_inv, block, torch.float32)
           + lin.bias.float()).view(3, 5, 2112)
    assert rel_max(y, ref) <= TIGHT_GPU + 2**-9


@pytest.mark.gpu
def test_gpu_gemm_cuda_graph():
    """No host sync: captured in a CUDA graph and replayed on new input, equal to eager."""
    from hybridmoe.layers.fp8_kernels import w8a8_block_gemm

    _needs_fp8_gpu()
    wq, ws = (t.cuda() for t in make_weight(576, 7168, (128, 128), 8))
    x = torch.randn(4, 7168, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        w8a8_block_gemm(x, wq, ws, (128, 128))
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = w8a8_block_gemm(x, wq, ws, (128, 128))
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, w8a8_block_gemm(x, wq, ws, (128, 128)))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, 300])
def test_gpu_fused_moe_fp8_vs_dequantized(t):
    """CUDA, bf16, DeepSeek-like block 128: fp8 experts through the fused kernels against the same
    kernels on the dequantized bf16 weights (the same weight values; bf16 rounding of the
    intermediate only: tolerance 2e-2 as test_triton_moe's bf16), plus a CUDA graph replay."""
    from test_triton_moe import rel_err

    from hybridmoe.moe.triton_moe_kernels import fused_moe

    _needs_fp8_gpu()
    w = fp8_experts(16, 256, 1024, (128, 128), t)
    w = type(w)(**{f: (v.cuda() if isinstance(v, torch.Tensor) else v) for f, v in vars(w).items()})
    d = w.dequantized(torch.bfloat16)
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, 1024, generator=g).to(torch.bfloat16).cuda()
    ids = torch.rand(t, 16, generator=g).topk(4, dim=1).indices.cuda()
    tw = torch.softmax(torch.randn(t, 4, generator=g), dim=1).cuda()
    out = fused_moe(x, w.gate_up, w.down, ids, tw, gate_up_scale=w.gate_up_scale, down_scale=w.down_scale,
                    block=w.block)
    assert rel_err(out, fused_moe(x, d.gate_up, d.down, ids, tw)) <= 2e-2


def _interp_main() -> None:
    try:
        import triton  # noqa: F401
    except ImportError:
        print(json.dumps({"_skip": "triton is not installed"}))
        return
    cases = {
        **{f"quant:{n}": functools.partial(_quant_case, n) for n in QUANT_CASES},
        **{f"gemm:{n}": functools.partial(_gemm_case, n) for n in GEMM_CASES},
        **{f"moe:{n}": functools.partial(_moe_case, n) for n in MOE_CASES},
        "gemm:fp8_linear_3d": _fp8_linear_case,
    }
    print(json.dumps(collect(cases)))


if __name__ == "__main__" and "--interp" in sys.argv:
    _interp_main()


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
def test_group_quant_divides_exactly_on_cuda():
    """The quantizer compiled for sm_90 (no GPU needed) divides with IEEE division, as torch does:
    Triton's `/` on fp32 is CUDA's approximate division, whose one-ulp differences moved values
    across e4m3 rounding ties on the H200 (codes unlike the reference's; 4e-3 GEMM error)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hybridmoe.layers import fp8_kernels as fk

    kernel = fk._group_quant_kernel
    consts = {"GROUP": 128, "EPS_": fk.EPS, "FMAX": fk.E4M3_MAX}
    types = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
