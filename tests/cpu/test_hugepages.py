"""hybridmoe/cpu/hugepages.py: huge-page-advised CPU weights keep their values, shapes and page
ownership; small tensors and HYBRIDMOE_HUGEPAGES=0 stay plain."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.cpu import hugepages as hp
from hybridmoe.cpu.quant import owns_pages

needs_thp = pytest.mark.skipif(not hp.available(), reason="no transparent huge pages on this machine")


@needs_thp
@pytest.mark.parametrize("shape,dtype", [((3, 1 << 20), torch.bfloat16), ((4097 * 1024 + 3,), torch.uint8),
                                         ((1500, 777), torch.float32)])
def test_empty_is_aligned_owns_its_pages_and_holds_values(shape, dtype):
    t = hp.empty(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert hp.is_huge_aligned(t) and owns_pages(t)
    src = torch.randint(0, 255, shape, dtype=torch.uint8).to(dtype)
    t.copy_(src)
    assert torch.equal(t, src)


def test_small_and_switched_off_are_plain(monkeypatch):
    small = hp.empty((7, 5), torch.float32)
    assert small.untyped_storage().nbytes() == small.nbytes == 140  # plain torch.empty: no 2 MB padding
    monkeypatch.setenv("HYBRIDMOE_HUGEPAGES", "0")
    assert not hp.available()
    big = torch.randn(2048, 1024)
    assert hp.to_huge(big) is big
    plain = hp.empty((2048, 1024), torch.float32)
    assert plain.untyped_storage().nbytes() == plain.nbytes


@needs_thp
def test_to_huge_and_move_params_keep_values():
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(1536, 1024, bias=True)  # 6 MB weight moves, the 4 KB bias stays
    small = torch.nn.Linear(8, 8)
    model = torch.nn.Sequential(lin, torch.nn.ReLU(), small)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(3, 1536, generator=g)
    ref = lin(x)
    w_before, b_before = lin.weight.data, lin.bias.data
    moved = hp.move_params(model)
    assert moved == lin.weight.nbytes
    assert hp.is_huge_aligned(lin.weight) and lin.bias.data_ptr() == b_before.data_ptr()
    assert torch.equal(lin.weight, w_before)
    assert torch.equal(lin(x), ref)
    held = lin.weight.data
    assert hp.to_huge(held) is held  # already there: no copy
    strided = torch.randn(1024, 2048, generator=g).t()  # not contiguous: copied contiguous
    out = hp.to_huge(strided)
    assert out.is_contiguous() and torch.equal(out, strided)
