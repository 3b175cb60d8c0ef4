"""ExpertWeights in block-scaled fp8: dequantization against a per-block reference, and select()."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.moe.experts import ExpertWeights
from hybridmoe.weights.fp8 import block_quant


def _fp8_experts(e: int, i: int, h: int, block: tuple[int, int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    parts = [(block_quant(gate_up[x, :i], block), block_quant(gate_up[x, i:], block), block_quant(down[x], block))
             for x in range(e)]
    w = ExpertWeights(
        gate_up=torch.stack([torch.cat([a[0], b[0]]) for a, b, _ in parts]),
        down=torch.stack([c[0] for _, _, c in parts]),
        gate_up_scale=torch.stack([torch.cat([a[1], b[1]]) for a, b, _ in parts]),
        down_scale=torch.stack([c[1] for _, _, c in parts]), block=block)
    return w, gate_up, down


def _ref_dequant(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Element by block: w[r, c] = q[r, c] * scale[r // bn, c // bk] (the definition, slow)."""
    rows = torch.arange(q.shape[0])[:, None] // block[0]
    cols = torch.arange(q.shape[1])[None, :] // block[1]
    return q.float() * scale[rows, cols]


@pytest.mark.parametrize("i,h,block", [(40, 72, (16, 32)), (48, 64, (16, 16)), (7, 9, (4, 4))])
def test_fp8_dequantized_matches_block_definition(i, h, block):
    w, gate_up, down = _fp8_experts(3, i, h, block)
    assert w.is_fp8 and w.gate_up.dtype == torch.float8_e4m3fn
    nbi = -(-i // block[0])
    assert tuple(w.gate_up_scale.shape) == (3, 2 * nbi, -(-h // block[1]))
    r = w.dequantized(torch.float32)
    assert not r.is_fp8 and r.gate_up.dtype == torch.float32
    for x in range(3):
        ref_gu = torch.cat([_ref_dequant(w.gate_up[x, :i], w.gate_up_scale[x, :nbi], block),
                            _ref_dequant(w.gate_up[x, i:], w.gate_up_scale[x, nbi:], block)])
        torch.testing.assert_close(r.gate_up[x], ref_gu, rtol=0, atol=0)
        torch.testing.assert_close(r.down[x], _ref_dequant(w.down[x], w.down_scale[x], block), rtol=0, atol=0)
    # e4m3 keeps 3 mantissa bits: about 2-3% relative error of a Gaussian matrix, never 10%
    assert ((r.gate_up - gate_up).norm() / gate_up.norm()).item() < 0.05
    assert ((r.down - down).norm() / down.norm()).item() < 0.05


def test_select_keeps_scales_and_non_fp8_is_unchanged():
    w, _, _ = _fp8_experts(4, 40, 72, (16, 32))
    s = w.select(slice(1, 3))
    assert s.gate_up.data_ptr() == w.gate_up[1].data_ptr()  # a view, no copy
    torch.testing.assert_close(s.dequantized(torch.float32).down, w.dequantized(torch.float32).down[1:3])
    picked = w.select(torch.tensor([3, 0]))
    torch.testing.assert_close(picked.dequantized(torch.float32).gate_up,
                               w.dequantized(torch.float32).gate_up[[3, 0]])
    plain = ExpertWeights(torch.randn(2, 8, 4), torch.randn(2, 4, 4))
    assert plain.dequantized(torch.bfloat16) is plain and not plain.is_fp8
