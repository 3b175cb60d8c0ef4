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


def test_kernel_interpreter():
    pytest.importorskip("triton")
    assert_interpreted(__file__, "cases")


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
def test_kernel_cuda():
    failures: list[str] = []
    check_cases("cuda", failures)
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


if __name__ == "__main__":  # interpreter entry point: python tests/gguf/test_triton_dequant.py cases
    import os

    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 (before triton is imported)"
    bad: list[str] = []
    check_cases("cpu", bad)
    sys.exit(1 if bad else 0)
