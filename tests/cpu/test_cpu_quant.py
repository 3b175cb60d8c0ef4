"""Reference quantizers and the packed layout: round trips and error bounds."""

import pytest
import torch

from hybridmoe.cpu import quant


def test_int8_roundtrip_bound():
    torch.manual_seed(0)
    w = torch.randn(3, 48, 200)
    q, s = quant.quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    err = (quant.dequantize_int8(q, s) - w).abs()
    assert (err <= s.unsqueeze(-1) / 2 + 1e-7).all()  # half a step per element


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("sym", [True, False])
def test_int4_roundtrip_bound(group, sym):
    torch.manual_seed(1)
    w = torch.randn(2, 32, 256)
    u, d, m = quant.quantize_int4(w, group, sym)
    assert u.dtype == torch.uint8 and int(u.max()) <= 15
    back = quant.dequantize_int4(u, d, m, group)
    step = d.repeat_interleave(group, dim=-1)
    # symmetric: the clamp at -8 never bites (|q| <= 7), so both are within half a step
    assert ((back - w).abs() <= step / 2 + 1e-6).all()


def test_int4_zero_group():
    w = torch.zeros(1, 16, 64)
    for sym in (True, False):
        u, d, m = quant.quantize_int4(w, 32, sym)
        assert torch.equal(quant.dequantize_int4(u, d, m, 32), w)


def test_act_quant_matches_formula():
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, s = quant.quantize_act_int8(x)
    assert q.tolist() == [[64, -127, 32, 0], [0, 0, 0, 0]]  # 63.5 rounds to even
    assert s[0].item() == pytest.approx(1 / 127)
    assert s[1].item() == 0


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4", "BF16", "FP8"])
def test_pack_unpack_layer(method):
    torch.manual_seed(2)
    e, h, i = 3, 100, 40
    gu, dn = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    p = quant.pack_layer(gu, dn, method, group_size=32)
    assert p.hidden_pad % 64 == 0 and p.inter_pad % 64 == 0
    g2, d2 = p.dequantized()
    assert g2.shape == gu.shape and d2.shape == dn.shape
    tol = {"AMXINT8": 0.01, "AMXINT4": 0.12, "BF16": 0.005, "FP8": 0.04}[method]  # FP8: e4m3, 3 mantissa bits
    assert (g2 - gu).norm() / gu.norm() < tol and (d2 - dn).norm() / dn.norm() < tol
    # layout round trips exactly
    w13 = quant.interleave_w13(gu, p.inter_pad, p.hidden_pad)
    assert torch.equal(quant.deinterleave_w13(w13, i, h), gu)
    q, _ = quant.quantize_int8(w13)
    assert torch.equal(quant.unpack_blocks(quant.pack_blocks(q, 1), *q.shape[1:], torch.int8), q)
    u, _, _ = quant.quantize_int4(w13, 64)
    assert torch.equal(quant.unpack_int4_blocks(quant.pack_int4_blocks(u), *u.shape[1:]), u)
    # the serialized form rebuilds the same layer
    p2 = quant.PackedLayer.from_tensors(p.meta(), p.tensors())
    assert torch.equal(p2.dequantized()[1], d2)


def test_block_layout_is_vnni():
    # element (row n, k) of an int8 matrix sits at block n//16, step k//4, byte (n%16)*4 + k%4
    q = torch.arange(32 * 64, dtype=torch.int32).reshape(1, 32, 64).remainder(127).to(torch.int8)
    p = quant.pack_blocks(q, 1).reshape(2, 16, 64)
    for n, k in [(0, 0), (5, 7), (17, 63), (31, 12)]:
        assert p[n // 16, k // 4, (n % 16) * 4 + k % 4] == q[0, n, k]


@pytest.mark.parametrize("shape,dtype", [((3, 1000), torch.float32), ((1,), torch.int8), ((5, 4096), torch.uint8),
                                         ((0, 7), torch.float32)])
def test_page_aligned_owns_its_pages(shape, dtype):
    """Page-locking in place needs tensors that start on a page and whose last page is theirs."""
    from hybridmoe.cpu.quant import page_aligned

    t = (torch.randn(shape) * 50).to(dtype)
    a = page_aligned(t)
    if t.numel() == 0:
        assert a.numel() == 0
        return
    assert a.data_ptr() % 4096 == 0 and a.shape == t.shape and a.dtype == t.dtype and torch.equal(a, t)
    storage = a.untyped_storage()
    end = a.data_ptr() + -(-max(a.nbytes, 1) // 4096) * 4096
    assert storage.data_ptr() <= a.data_ptr() and end <= storage.data_ptr() + storage.nbytes()


def test_pack_layer_page_aligned_output_needs_no_copy():
    """pack_layer(page_align=True) writes its result into page-owning tensors: page_aligned_layer
    then keeps them as they are (no second copy of the weights at load)."""
    from hybridmoe.cpu.quant import owns_pages, page_aligned_layer

    g = torch.Generator().manual_seed(3)
    gu, dn = torch.randn(5, 2 * 40, 72, generator=g), torch.randn(5, 72, 40, generator=g)
    for method in ("AMXINT8", "AMXINT4", "BF16", "FP8"):
        ref = quant.pack_layer(gu, dn, method, group_size=32, chunk=2)
        p = quant.pack_layer(gu, dn, method, group_size=32, chunk=2, page_align=True)
        for name, t in p.tensors().items():
            assert owns_pages(t), f"{method} {name}"
            assert torch.equal(t, ref.tensors()[name]), f"{method} {name}"
        again = page_aligned_layer(p)
        assert all(a.data_ptr() == b.data_ptr() for a, b in zip(again.tensors().values(), p.tensors().values()))
