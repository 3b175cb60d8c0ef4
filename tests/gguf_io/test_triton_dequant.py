"""The GGUF dequantizing Triton kernel (hybridmoe/gguf/triton_dequant.py) against the torch reference
(cpu/gguf_quant.dequantize, itself checked against gguf.quants.dequantize in tests/cpu/test_gguf_quant.py).

Bound: exact. The kernel's fp32 values are the reference's bit for bit (the module docstring says why)
and its bf16 / f16 outputs are the reference rounded once to nearest even, so every case asserts
torch.equal(out, reference.to(dtype)) (NaN-free inputs: scales are finite fp16 values).

CPU/CI: every case runs under the Triton interpreter in a subprocess (TRITON_INTERPRET must be set
before triton is imported); the kernel also compiles for sm_90 here. GPU (`-m gpu`): the same cases on
CUDA, plus a layer-sized one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (also when run as the interpreter script)
from hybridmoe.cpu import gguf_quant as gq  # noqa: E402

from interpreter import assert_interpreted, report  # noqa: E402

TYPES = ("Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def _blocks(name: str, e: int, n: int, k: int, seed: int, scales: str) -> torch.Tensor:
    """uint8 [e, n, RB]: random valid blocks ("pos": random_blocks' small positive scales), the same
    with random finite fp16 scales of both signs, subnormals and zeros included ("any"), or our / gguf's
    quantizers on Gaussian rows ("quant")."""
    g = torch.Generator().manual_seed(seed)
    if scales == "quant":
        return gq.quantize(torch.randn(e, n, k, generator=g), name)
    b = gq.random_blocks(name, e * n, k, generator=g) if e * n else torch.zeros(0, gq.row_bytes(name, k),
                                                                                  dtype=torch.uint8)
    if scales == "any" and e * n:
        tid = gq.type_id(name)
        _, _, ts = gq.TYPES[tid]
        blk = b.view(-1, ts)
        for off in {2: [0], 8: [0], 12: [0, 2], 13: [0, 2], 14: [208], 23: [0]}[tid]:
            bits = torch.randint(0, 1 << 16, (blk.shape[0],), generator=g, dtype=torch.int32)
            bits = torch.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits)  # no inf / NaN exponents
            bits[::7] = 0  # exact zeros
            bits[3::7] &= 0x83FF  # subnormals
            blk[:, off], blk[:, off + 1] = (bits & 255).to(torch.uint8), (bits >> 8).to(torch.uint8)
    return b.view(e, n, gq.row_bytes(name, k))


# (E, N, K multiplier of the block size, scales): odd row counts, one row, one block, empty sides
SHAPES = [(1, 1, 1, "pos"), (3, 7, 2, "pos"), (2, 33, 3, "any"), (1, 5, 1, "any"), (2, 9, 2, "quant"),
          (0, 4, 1, "pos"), (2, 0, 1, "pos")]


def check_cases(device: str, failures: list[str]) -> None:
    """Every type x shape x output dtype, 3-D and 2-D inputs, and a strided destination (the gate and up
    halves of a gate_up buffer, as the layerwise prefill writes them)."""
    from hybridmoe.gguf import triton_dequant as td

    for name in TYPES:
        bs = gq.TYPES[gq.type_id(name)][1]
        for si, (e, n, mult, scales) in enumerate(SHAPES):
            k = bs * mult if bs == 256 else bs * (2 * mult + 1)  # 32-value types: odd block counts per row
            b = _blocks(name, e, n, k, seed=si, scales=scales)
            ref = gq.dequantize(b, name) if b.numel() else torch.zeros(e, n, k)
            bd = b.to(device)
            for dn, dt in DTYPES.items():
                out = torch.full((e, n, k), float("nan"), dtype=dt, device=device)
                td.dequantize_triton(bd, name, out)
                ok = torch.equal(out.cpu(), ref.to(dt))
                report(ok, f"{name} E={e} N={n} K={k} {scales} {dn}", failures)
            if e and n:
                out2 = torch.empty(n, k, dtype=torch.bfloat16, device=device)
                td.dequantize_triton(bd[-1], name, out2)
                report(torch.equal(out2.cpu(), ref[-1].bfloat16()), f"{name} 2-D N={n} K={k}", failures)
                gate_up = torch.full((e, 2 * n, k), float("nan"), dtype=torch.bfloat16, device=device)
                td.dequantize_triton(bd, name, gate_up[:, n:])  # the up half; the gate half stays untouched
                ok = torch.equal(gate_up[:, n:].cpu(), ref.bfloat16()) and bool(gate_up[:, :n].isnan().all())
                report(ok, f"{name} strided destination E={e} N={n}", failures)


def check_layerwise(device: str, failures: list[str]) -> None:
    """The layerwise prefill's GGUF path with the kernel (under the interpreter on the CPU): two hybrid
    layers of different, mixed types share the staging slots; each layer's streamed experts land in
    the bf16 buffer as the reference rounded once, and the layer output is the torch experts' on those
    weights (rel < 1e-2: bf16 weights and activations, two expert calls summed in fp32)."""
    from hybridmoe.config import HybridConfig
    from hybridmoe.cpu.gguf_engine import GGUFExperts
    from hybridmoe.gguf import triton_dequant as td
    from hybridmoe.gguf.gpu_experts import gpu_expert_weights, select_experts
    from hybridmoe.moe.experts import ExpertWeights
    from hybridmoe.moe.hybrid import HybridExperts
    from hybridmoe.moe.options import ExpertsOptions
    from hybridmoe.moe.placement import HybridPlacement
    from hybridmoe.moe.runtime import HybridRuntime
    from hybridmoe.moe.torch_experts import TorchExperts

    calls = []
    real = td.dequantize_triton
    td.dequantize_triton = lambda *a: calls.append(a[1]) or real(*a)
    g = torch.Generator().manual_seed(0)
    e, h, i, k, t = 7, 256, 256, 3, 11  # every program is interpreted: one super-block a down row
    masks = {0: torch.tensor([1, 0, 0, 1, 0, 1, 0], dtype=torch.bool), 2: torch.tensor([0, 0, 1, 0, 0, 0, 0],
                                                                                       dtype=torch.bool)}
    rt = HybridRuntime(HybridPlacement(masks, (0, 2), 0, "torch", prefill_threshold=1), torch.device(device), None)
    layers, refs = {}, {}
    for layer, types in ((0, ("Q4_K", "Q6_K", "Q8_0")), (2, ("IQ4_XS", "Q4_0", "Q5_K"))):
        mats = [gq.random_blocks(ty, e * n, kk, generator=g).view(e, n, -1)
                for ty, (n, kk) in zip(types, ((i, h), (i, h), (h, i)))]
        x = GGUFExperts.of(*mats, types)
        m = masks[layer]
        layers[layer] = HybridExperts(gpu_expert_weights(x, m, torch.bfloat16), layer, ExpertsOptions(
            hybrid=HybridConfig(method="LLAMAFILE"), runtime=rt, packed=select_experts(x, (~m).nonzero().flatten(), page_align=device == "cuda")))
        gu, dn = x.dequantized()
        refs[layer] = ExpertWeights(gu.bfloat16(), dn.bfloat16())
    rt.attach(layers)
    x = torch.randn(t, h, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=g)
    xd, idsd, wtsd = x.to(device), ids.to(device), wts.to(device)
    with rt.forward_scope(t):
        for layer, lay in layers.items():
            out = lay.forward(xd, idsd, wtsd).cpu()
            ec, m = lay.num_streamed, masks[layer]
            buf = rt.layerwise.buffer
            exact = torch.equal(buf.gate_up[:ec].cpu(), refs[layer].gate_up[~m]) and \
                torch.equal(buf.down[:ec].cpu(), refs[layer].down[~m])
            report(exact, f"layerwise layer {layer}: {ec} streamed experts dequantized exactly into the buffer",
                   failures)
            ref = TorchExperts(ExpertWeights(refs[layer].gate_up.float(), refs[layer].down.float())).forward(
                x.float(), ids, wts)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            report(err < 1e-2, f"layerwise layer {layer}: output rel err {err:.2e} (tol 1e-2)", failures)
    report(sorted(calls) == sorted([12, 14, 8, 23, 2, 13]), f"the kernel ran for every projection: {calls}",
           failures)
    td.dequantize_triton = real


GROUPS = {"cases": check_cases, "layerwise": check_layerwise}


# ---- in the test process (no Triton) -------------------------------------------------------------


@pytest.mark.parametrize("name", TYPES)
def test_torch_path_is_the_reference(name, monkeypatch):
    """dequantize_torch (the CPU device's path) in chunks of one matrix and in one pass."""
    from hybridmoe.gguf import triton_dequant as td

    b = _blocks(name, 3, 5, 512, seed=1, scales="any")
    ref = gq.dequantize(b, name)
    for chunk in (td.CPU_CHUNK_ELEMS, 1):
        monkeypatch.setattr(td, "CPU_CHUNK_ELEMS", chunk)
        out = torch.empty(3, 5, 512, dtype=torch.bfloat16)
        assert td.dequantize_torch(b, name, out) is out
        assert torch.equal(out, ref.bfloat16())


def test_bad_arguments_are_clear_errors():
    from hybridmoe.gguf import triton_dequant as td

    b = gq.random_blocks("Q4_K", 4, 512).view(2, 2, -1)
    with pytest.raises(ValueError, match="do not match out"):
        td.dequantize_torch(b, "Q4_K", torch.empty(2, 2, 256))
    with pytest.raises(ValueError, match="contiguous"):
        td.dequantize_torch(b.transpose(0, 1), "Q4_K", torch.empty(2, 2, 512))
    with pytest.raises(ValueError, match="uint8"):
        td.dequantize_torch(b.float(), "Q4_K", torch.empty(2, 2, 512))
    with pytest.raises(ValueError, match="no CPU kernel"):
        td.dequantize_torch(b, "Q2_K", torch.empty(2, 2, 512))


# ---- the kernel under the interpreter, and compiled for sm_90 ------------------------------------


@pytest.mark.parametrize("group", ["cases", "layerwise"])
def test_kernel_interpreter(group):
    pytest.importorskip("triton")
    assert_interpreted(__file__, group)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("out", ["bf16", "fp32"])
def test_kernel_compiles_sm90(name, out):
    """What only the compiler rejects (types of the bit operations, the bitcasts) shows up here."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hybridmoe.gguf import triton_dequant as td

    k = td._gguf_dequant_kernel
    tid = gq.type_id(name)
    _, bs, ts = gq.TYPES[tid]
    consts = dict(TYPE=tid, BS=bs, TS=ts, NB=td._NB[bs], OUT_BF16=out == "bf16")
    types = dict(src="*u8", dst="*i16" if out == "bf16" else "*fp32", kv="*fp32", src_estride="i64",
                 dst_estride="i64", nblocks="i32")
    sig = {n: "constexpr" if n in consts else types[n] for n in k.arg_names}
    src = ASTSource(fn=k, signature=sig, constexprs={(k.arg_names.index(n),): v for n, v in consts.items()})
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


# ---- CUDA ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("group", ["cases", "layerwise"])
def test_kernel_cuda(group):
    failures: list[str] = []
    GROUPS[group]("cuda", failures)
    assert not failures, failures


@pytest.mark.gpu
@pytest.mark.parametrize("name", TYPES)
def test_kernel_cuda_layer_sized(name):
    """A Qwen3-30B-A3B-sized gate matrix set (64 experts x 768 x 2048) into a bf16 gate_up buffer; prints
    the kernel's read bandwidth."""
    from hybridmoe.gguf import triton_dequant as td

    e, n, k = 64, 768, 2048
    b = _blocks(name, e, n, k, seed=3, scales="pos").cuda()
    gate_up = torch.empty(e, 2 * n, k, dtype=torch.bfloat16, device="cuda")
    td.dequantize_into(b, name, gate_up[:, :n])
    torch.cuda.synchronize()
    assert torch.equal(gate_up[:, :n].cpu(), gq.dequantize(b.cpu(), name).bfloat16())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        td.dequantize_into(b, name, gate_up[:, :n])
    end.record()
    torch.cuda.synchronize()
    s = start.elapsed_time(end) / 10 / 1e3
    print(f"{name}: {s * 1e6:.0f} us for {e}x{n}x{k}: {(b.nbytes + e * n * k * 2) / s / 1e9:.0f} GB/s read+write")


if __name__ == "__main__":  # interpreter entry point: python tests/gguf_io/test_triton_dequant.py [cases|layerwise]
    import os

    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 (before triton is imported)"
    bad: list[str] = []
    for name in sys.argv[1:] or sorted(GROUPS):
        GROUPS[name]("cpu", bad)
    sys.exit(1 if bad else 0)
