"""The native load-time quantizers (hybridmoe/cpu/pack.py, csrc/quantize.cpp) against the torch
reference (quant.pack_layer): bit-identical packed tensors for every native method, odd sizes,
f32/bf16/f16 inputs and edge values (zero rows and groups, the largest magnitudes, rounding ties,
subnormals); and the random layers drawn directly in packed form."""

import zlib

import pytest
import torch

from hybridmoe.cpu import pack, quant
from hybridmoe.cpu.engine import CPUMoELayer, CPUThreadPool
from hybridmoe.cpu.reference import moe_reference, rel_error

CASES = [("AMXINT8", 128, True), ("BF16", 128, True)] + [
    ("AMXINT4", g, s) for g in quant.GROUP_SIZES for s in (True, False)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of t: NaN-proof, -0.0 != 0.0 equality."""
    return t.contiguous().view(torch.uint8)


def assert_same(a: quant.PackedLayer, b: quant.PackedLayer) -> None:
    assert a.meta() == b.meta()
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    for name in ta:
        assert ta[name].shape == tb[name].shape and ta[name].dtype == tb[name].dtype, name
        diff = (_bits(ta[name]) != _bits(tb[name])).sum().item()
        assert diff == 0, f"{name}: {diff} bytes differ"


def edge_weights(e: int, i: int, h: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights with edge rows: zeros, the dtype's largest magnitudes, exact rounding ties
    (x.5 steps once scaled: rows whose amax is 127, groups whose amax is 7), subnormals, one-hot."""
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(e, 2 * i, h, generator=g) * 0.05
    dn = torch.randn(e, h, i, generator=g) * 0.05
    big = torch.finfo(dtype).max
    for w in (gu, dn):
        n, k = w.shape[1:]
        w[0, 0] = 0.0  # a zero row
        w[0, 1] = big * torch.sign(torch.randn(k, generator=g))  # max magnitude, both signs
        w[0, 2] = torch.randint(-254, 255, (k,), generator=g) / 2.0  # x.5 ties, amax 127 (set below)
        w[0, 2, 0] = 127.0
        w[0, 3] = torch.randint(-14, 15, (k,), generator=g) / 2.0  # int4 ties: every group's amax 7
        w[0, 3, ::32] = 7.0
        w[0, 4] = 1e-40  # subnormal (f32) / flushed to zero below
        w[0, 5] = 0.0
        w[0, 5, k // 2] = -3.0  # one-hot
        w[-1, :, :32] = 0.0  # zero int4 groups
        if n > 6:
            w[0, 6] = torch.randn(k, generator=g) * 1e3
    return gu.to(dtype), dn.to(dtype)


@pytest.fixture(scope="module")
def qpool():
    p = CPUThreadPool(threads=2)
    yield p
    p.close()


@pytest.mark.parametrize("method,group,sym", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_native_equals_reference(method, group, sym, dtype, qpool):
    e, i, h = 3, 72, 200  # both padded (to 128 / 256), i not a multiple of 16
    gu, dn = edge_weights(e, i, h, dtype, seed=zlib.crc32(f"{method}-{group}-{sym}-{dtype}".encode()) % 1000)
    ref = quant.pack_layer(gu, dn, method, group_size=group, symmetric=sym)
    got = pack.pack_layer(gu, dn, method, group_size=group, symmetric=sym, pool=qpool)
    assert pack.native_supported(method, gu, None)
    assert_same(got, ref)


@pytest.mark.parametrize("e,i,h", [(1, 16, 64), (2, 768 // 8, 2048 // 8), (5, 33, 70)])
def test_native_sizes(e, i, h, qpool):
    g = torch.Generator().manual_seed(e * 1000 + i)
    gu = torch.randn(e, 2 * i, h, generator=g).bfloat16()
    dn = torch.randn(e, h, i, generator=g).bfloat16()
    for method, group, sym in (("AMXINT8", 128, True), ("AMXINT4", 64, False)):
        assert_same(pack.pack_layer(gu, dn, method, group_size=group, symmetric=sym, pool=qpool),
                    quant.pack_layer(gu, dn, method, group_size=group, symmetric=sym))


def test_native_no_experts(qpool):
    lay = pack.pack_layer(torch.zeros(0, 32, 64), torch.zeros(0, 64, 16), "AMXINT8", pool=qpool)
    assert lay.w13.data.shape == (0, 128 * 64) and lay.w2.scale.shape == (0, 64)  # padded: I 64, H 64


def test_native_strided_source_and_page_align(qpool):
    g = torch.Generator().manual_seed(5)
    base = torch.randn(4, 2 * 48, 130, generator=g).bfloat16()
    gu = base[:, :, :128]  # rows not contiguous: the row stride is passed through
    dn = torch.randn(4, 128, 48, generator=g).bfloat16()
    got = pack.pack_layer(gu, dn, "AMXINT8", page_align=True, pool=qpool)
    assert_same(got, quant.pack_layer(gu, dn, "AMXINT8"))
    assert all(quant.owns_pages(t) for t in got.tensors().values())


def test_fp8_input_dequantized_then_packed(qpool):
    g = torch.Generator().manual_seed(6)
    gu = torch.randn(3, 2 * 128, 256, generator=g).to(torch.float8_e4m3fn)
    dn = torch.randn(3, 256, 128, generator=g).to(torch.float8_e4m3fn)
    gs = torch.rand(3, 2, 2, generator=g) + 0.5
    ds = torch.rand(3, 2, 1, generator=g) + 0.5
    kw = dict(fp8_scales=(gs, ds), fp8_block=(128, 128), chunk=2)
    assert_same(pack.pack_layer(gu, dn, "AMXINT4", group_size=32, pool=qpool, **kw),
                quant.pack_layer(gu, dn, "AMXINT4", group_size=32, **kw))


def test_other_paths_fall_back_to_reference():
    gu, dn = torch.randn(2, 64, 64), torch.randn(2, 64, 32)
    assert not pack.native_supported("FP8", gu, None)
    assert not pack.native_supported("AMXINT8", gu, "meta")
    assert_same(pack.pack_layer(gu, dn, "FP8", group_size=64), quant.pack_layer(gu, dn, "FP8", group_size=64))


def test_native_rejects_bad_arguments(qpool):
    gu, dn = torch.randn(2, 64, 64).bfloat16(), torch.randn(2, 64, 32).bfloat16()
    with pytest.raises(ValueError, match="group"):
        pack.pack_layer(gu, dn, "AMXINT4", group_size=48, pool=qpool)
    with pytest.raises(ValueError, match="down has shape"):
        pack.pack_layer(gu, dn[:, :, :16], "AMXINT8", pool=qpool)
    out = pack.empty_matrix(1, 64, 64, "AMXINT8", 128, True)
    with pytest.raises(ValueError, match="past"):
        pack.quantize_into(torch.zeros(2, 64, 64), out, "AMXINT8", 128, True, pool=qpool)
    with pytest.raises(ValueError, match="padded"):
        pack.quantize_into(torch.zeros(1, 80, 64), out, "AMXINT8", 128, True, pool=qpool)


@pytest.mark.parametrize("method,group,sym", [("AMXINT8", 128, True), ("AMXINT4", 32, True), ("AMXINT4", 128, False),
                                               ("BF16", 128, True)])
def test_random_packed_layer(method, group, sym, qpool):
    e, h, i = 4, 200, 72
    lay = pack.random_packed_layer(e, h, i, method, group, sym, std=0.02, seed=3, pool=qpool)
    gu, dn = lay.dequantized()
    for w in (gu, dn):
        assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 2e-3
    # the packed form is what quantizing its own dequantized weights gives, pads included (int8: exact
    # round trip of the codes; int4/bf16 likewise), and the draw is fixed by the seed, not the threads
    one = CPUThreadPool(threads=1)
    try:
        assert_same(pack.random_packed_layer(e, h, i, method, group, sym, std=0.02, seed=3, pool=one), lay)
    finally:
        one.close()
    other = pack.random_packed_layer(e, h, i, method, group, sym, std=0.02, seed=4, pool=qpool)
    assert not torch.equal(other.w13.data, lay.w13.data)
    if method == "AMXINT8":
        q = quant.unpack_blocks(lay.w13.data, lay.w13.n, lay.w13.k, torch.int8)
        assert torch.equal(q.sum(-1, dtype=torch.int32), lay.w13.wsum)
        assert (q[:, :, h:] == 0).all()  # padded columns


def test_random_packed_layer_runs(qpool):
    e, h, i, k = 8, 128, 64, 2
    lay = pack.random_packed_layer(e, h, i, "AMXINT8", pool=qpool)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, h, generator=g)
    ids = torch.randint(0, e, (3, k), generator=g)
    w = torch.rand(3, k, generator=g)
    gu, dn = lay.dequantized()
    out = CPUMoELayer(lay, pool=qpool).forward(x, ids, w)
    assert rel_error(out, moe_reference(x, ids, w, gu, dn, act_quant="int8")) < 2e-2


@pytest.mark.parametrize(("method", "group", "sym"), CASES[:3])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize(("where", "proj"), [("gate_up", "gate_proj"), ("gate_up", "up_proj"), ("down", "down_proj")])
def test_native_refuses_non_finite_weights(method, group, sym, bad, where, proj, qpool):
    """A NaN or an infinity in the source (a damaged checkpoint) is an error naming its expert, projection
    and row. Before, amax_of's max dropped a NaN (maxps returns its other operand) and the row was quantized to
    values that looked fine."""
    g = torch.Generator().manual_seed(3)
    e, i, h = 5, 48, 256
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    row = {"gate_proj": 17, "up_proj": 30, "down_proj": 201}[proj]
    if where == "gate_up":
        gate_up[3, row + (i if proj == "up_proj" else 0), 77] = bad
    else:
        down[3, row, 40] = bad
    with pytest.raises(pack.NonFiniteWeights, match=f"expert 3 {proj} row {row}: NaN or infinite") as info:
        pack.pack_layer(gate_up, down, method, group, sym, pool=qpool)
    assert (info.value.expert, info.value.proj, info.value.row) == (3, proj, row)
