"""pack_layer assembles its chunks into tensors allocated once (cpu/packed_assembly.py): the result is the
same for every chunk size, page-aligned when asked, and an incomplete assembly is an error."""

import pytest
import torch

from hybridmoe.cpu.packed_assembly import PackedAssembly
from hybridmoe.cpu.quant import PackedMatrix, pack_layer


def _layer(e=7, h=64, i=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(e, 2 * i, h, generator=g) * 0.05, torch.randn(e, h, i, generator=g) * 0.05


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4", "BF16"])
def test_chunk_size_does_not_change_the_packed_layer(method):
    gu, dn = _layer()
    whole = pack_layer(gu, dn, method, group_size=32, chunk=7)
    for chunk in (1, 3):
        part = pack_layer(gu, dn, method, group_size=32, chunk=chunk, page_align=chunk == 3)
        for a, b in ((whole.w13, part.w13), (whole.w2, part.w2)):
            for f in ("data", "scale", "zero", "wsum"):
                x, y = getattr(a, f), getattr(b, f)
                assert (x is None) == (y is None)
                if x is not None:
                    assert torch.equal(x, y), f
        if chunk == 3:
            assert part.w13.data.data_ptr() % 4096 == 0 and part.w2.data.data_ptr() % 4096 == 0


def test_incomplete_assembly_is_an_error():
    asm = PackedAssembly(3)
    asm.add(PackedMatrix(torch.zeros(2, 5, dtype=torch.int8), 5, 4, torch.ones(2, 1), None, None))
    with pytest.raises(ValueError, match="2 of 3"):
        asm.result()
    asm.add(PackedMatrix(torch.ones(1, 5, dtype=torch.int8), 5, 4, torch.ones(1, 1), None, None))
    out = asm.result()
    assert out.data.shape == (3, 5) and out.data[2].eq(1).all() and out.zero is None
    bad = PackedAssembly(2)
    bad.add(PackedMatrix(torch.zeros(1, 5), 5, 4, None, None, None))
    with pytest.raises(ValueError, match="disagree"):
        bad.add(PackedMatrix(torch.zeros(1, 5), 5, 4, torch.ones(1, 1), None, None))
