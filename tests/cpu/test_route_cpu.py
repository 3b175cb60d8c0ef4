"""The native softmax top-k routing (hybridmoe.cpu.route, csrc/route_cpu.cpp) against its torch
reference fused_ops.topk_softmax_ref (torch.softmax of logits.float(), torch.topk, weights / sum),
with fresh random logits: odd E and K on both of torch.topk's CPU algorithms (a K-heap for
K*64 <= E, nth_element + sort otherwise), T = 0, 1, 4, 7, bf16 and fp32 logits, renormalize on/off.

What must agree, and how closely:
- ids: equal, in torch's order, ties included. Heavy ties (logits drawn from a few integers, and
  bf16 logits, which repeat) pin the tie rule: torch.topk's on CPU, reproduced by running its
  algorithm on the logits. Where torch sees a tie we do not (two different logits whose float
  probabilities round to the same value) the pick may differ: that case is only checked to be a
  valid top-k set.
- weights: within 1 fp32 ulp of the float64 softmax of the same logits (ours computes in double from the
  fp32 logits on, one rounding at the end). torch's reference rounds the logit - max, its vectorized exp
  and a float sum in fp32: 12 ulps off the float64 softmax at E = 1000 on an AVX2-only machine (the
  AVX-512 ones saw at most 7, which the earlier bound of 8 ulps against torch relied on; ours was then
  11 ulps off too, from its fp32 logit - max). The near-tie tests below still compare with torch's (8).
- fused_ops.topk_softmax on CPU tensors is the native call (bit-identical to it), so the Python
  MoE block and the one-call layer route identically.
"""

from __future__ import annotations

import pytest
import torch

from hybridmoe.cpu.route import supports, topk_softmax_cpu
from hybridmoe.layers import fused_ops
from hybridmoe.layers.fused_ops import topk_softmax_ref

ULPS = 8


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in fp32 ulps between same-signed finite tensors."""
    if a.numel() == 0:
        return 0
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


def _exact(logits: torch.Tensor, ids: torch.Tensor, renorm: bool) -> torch.Tensor:
    """The weights of `ids` from the float64 softmax of the logits, rounded once to fp32."""
    p = torch.softmax(logits.double(), -1).gather(1, ids.long())
    return (p / p.sum(-1, keepdim=True) if renorm else p).float()


def _check(logits: torch.Tensor, k: int, renorm: bool, what: str) -> None:
    rw, rids = topk_softmax_ref(logits, k, renorm)
    w, ids = topk_softmax_cpu(logits, k, renorm)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == ids.shape == (logits.shape[0], k)
    assert torch.equal(ids, rids), f"{what}: ids {ids.tolist()} != torch's {rids.tolist()}"
    exact = _exact(logits, rids, renorm)  # torch's weights are not the yardstick: they are up to 12 ulps off it
    assert _ulps(w, exact) <= 1, f"{what}: weights {_ulps(w, exact)} ulps from the float64 softmax"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renorm", [False, True])
def test_random_logits_match_torch(dtype, renorm):
    g = torch.Generator().manual_seed(7 + int(renorm) + 2 * (dtype == torch.bfloat16))
    # (E, K): E odd and even, K odd; both algorithms: K*64 <= E (heap) and > E (nth_element)
    for e, k in ((1, 1), (5, 3), (10, 3), (60, 4), (128, 8), (129, 2), (129, 3), (257, 1), (257, 5), (1000, 15)):
        for t in (0, 1, 4, 7):
            for scale in (0.5, 4.0):
                logits = (torch.randn(t, e, generator=g) * scale).to(dtype)
                _check(logits, k, renorm, f"E={e} K={k} T={t} scale={scale} {dtype} renorm={renorm}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_follow_torch_topk(dtype):
    """Logits from a handful of values: most rows tie at the K-th place (and above it)."""
    g = torch.Generator().manual_seed(11)
    for e, k in ((7, 3), (16, 5), (128, 8), (129, 2), (300, 4), (64, 64)):
        for t in (1, 4):
            logits = torch.randint(-2, 3, (t, e), generator=g).to(dtype) * 0.5
            for renorm in (False, True):
                _check(logits, k, renorm, f"ties E={e} K={k} T={t}")
    _check(torch.zeros(3, 33, dtype=dtype), 5, True, "all equal")


def test_near_ties_pick_a_valid_set():
    """Different logits 1 ulp apart (torch's probabilities may round them equal): a valid top-k set
    with the right weights, whichever of the near-tied experts it is."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(4, 96, generator=g)
    base[:, 10:40] = 1.5 + torch.arange(30) * 2**-23  # 30 logits within 30 ulps of 1.5
    for k in (3, 12, 20):
        w, ids = topk_softmax_cpu(base, k, True)
        rw, _ = topk_softmax_ref(base, k, True)
        chosen = base.gather(1, ids.long())
        rest = base.scatter(1, ids.long(), float("-inf"))
        assert (chosen.min(1).values >= rest.max(1).values).all(), "not a top-k set"
        assert len(set(ids[0].tolist())) == k
        assert _ulps(w, rw) <= ULPS


def test_non_finite_rows_are_nan_like_torch():
    """A NaN or +inf logit (or an all -inf row) makes torch's whole row NaN; ours too, same ids."""
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(2))
    logits[0, 3] = float("nan")
    logits[1, 7] = float("inf")
    logits[2] = float("-inf")
    for renorm in (False, True):
        w, ids = topk_softmax_cpu(logits, 4, renorm)
        rw, rids = topk_softmax_ref(logits, 4, renorm)
        assert torch.equal(ids, rids)
        assert torch.isnan(w[:3]).all() and torch.isnan(rw[:3]).all()
        assert _ulps(w[3:], rw[3:]) <= ULPS


def test_strided_rows_and_the_dispatcher():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(5, 40, generator=g).bfloat16()
    rows = wide[:, :33]  # a row stride larger than E: read in place
    assert supports(rows, 4) and not rows.is_contiguous()
    _check(rows, 4, True, "row stride 40, E 33")
    cols = wide[:, ::2]  # not unit stride along E: the dispatcher falls back to torch
    assert not supports(cols, 4)
    w, ids = fused_ops.topk_softmax(cols, 4, False)
    rw, rids = topk_softmax_ref(cols, 4, False)
    assert torch.equal(w, rw) and torch.equal(ids, rids)
    # CPU fp32/bf16 logits: fused_ops.topk_softmax is the native call, bit for bit
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(3, 129, generator=g).to(dtype)
        a, b = fused_ops.topk_softmax(logits, 8, True), topk_softmax_cpu(logits, 8, True)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    half = torch.randn(2, 10, generator=g).half()  # a dtype the native routing does not take
    assert not supports(half, 2)
    assert torch.equal(fused_ops.topk_softmax(half, 2, True)[1], topk_softmax_ref(half, 2, True)[1])
    with pytest.raises(ValueError, match="1 <= k <= E"):
        topk_softmax_cpu(torch.randn(2, 4), 5, True)
