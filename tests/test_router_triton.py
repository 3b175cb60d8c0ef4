"""The one-token fused router (hybridmoe/moe/router_triton.py) against the two-step path it replaces.

CPU/CI: under the Triton interpreter in a subprocess (tests/interpreter.py). Per case: the kernel's logits
within one rounding step of the model dtype of the float64 GEMV rounded to it (fp32: 1e-5 relative to the row's
largest), and its weights and ids equal to fused_ops.topk_softmax_ref applied to those logits (weights within
1e-6: the interpreter's exp against torch's; ids exactly, ties aside: random rows have none). The ticket is 0
after each launch (the next launch relies on it); a NaN hidden state gives K distinct ids in [0, E) and NaN
weights. GPU (`-m gpu`): the same in bf16, and the MoE block's forward with the fused router against
HYBRIDMOE_ROUTER_FUSED=0, eagerly and replayed in a CUDA graph. The launch also counts the chosen experts
(the recorder's count): once per launch, nothing for a padding row (valid_rows[0] == 0).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from interpreter import case_result, collect, json_results

# name -> (H, E, K, renormalize, dtype)
CASES = {
    "h72_e8_k2_renorm": (72, 8, 2, True, torch.float32),
    "h1000_e60_k4": (1000, 60, 4, False, torch.float32),
    "h2100_e128_k8_renorm": (2100, 128, 8, True, torch.float32),
    "h2048_e128_k8_fp16": (2048, 128, 8, True, torch.float16),
    "h300_e256_k1": (300, 256, 1, False, torch.float32),
    "h64_e3_k3_fp16": (64, 3, 3, False, torch.float16),
}
ULP = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}  # a rounding step, relative to the max


def _run_case(name: str, device: str = "cpu", dtype: torch.dtype | None = None, nan: bool = False) -> dict:
    from hybridmoe.layers.fused_ops import topk_softmax_ref
    from hybridmoe.moe.router_triton import new_ticket, router_topk

    H, E, K, renorm, dt = CASES[name]
    dt = dtype or dt
    g = torch.Generator().manual_seed(len(name) + nan)
    x = torch.randn(1, H, generator=g)
    if nan:
        x[0, H // 3] = float("nan")
    w = torch.randn(E, H, generator=g) / H**0.5
    x, w = x.to(device, dt), w.to(device, dt)
    ticket = new_ticket(torch.device(device))
    counts = torch.zeros(E, dtype=torch.int64, device=device)
    out = []
    # twice through one ticket (the second launch needs the first to have reset it), counting the experts: the
    # first launch every row, the second only if valid_rows[0] > 0 (0 here: a graph's padding row)
    for valid in (None, torch.zeros(1, dtype=torch.int64, device=device)):
        out.append(router_topk(x, w, K, renorm, ticket, counts=counts, valid_rows=valid))
        if int(ticket.item()) != 0:
            return {"ok": False, "why": f"ticket {int(ticket.item())} after a launch"}
    (wt, ids, logits), (wt2, ids2, _) = out
    res = {"ids_in_range": bool(((ids >= 0) & (ids < E)).all()), "distinct": len(set(ids[0].tolist())) == K,
           "repeat_equal": torch.equal(ids, ids2) and torch.equal(wt.isnan(), wt2.isnan()),
           "counted_once": torch.equal(counts.cpu(), torch.bincount(ids[0].long().cpu(), minlength=E))}
    if nan:
        return {**res, "ok": res["ids_in_range"] and res["distinct"] and bool(wt.isnan().all())}
    ref_logits = torch.nn.functional.linear(x.double(), w.double()).to(dt).double()
    lerr = ((logits.double() - ref_logits).abs().max() / ref_logits.abs().max()).item()
    rw, rids = topk_softmax_ref(logits, K, renorm)
    same = torch.equal(torch.sort(ids, dim=1).values, torch.sort(rids, dim=1).values)
    order = ids.argsort(dim=1)
    werr = (wt.gather(1, order) - rw.gather(1, rids.argsort(dim=1))).abs().max().item() if same else float("inf")
    ok = lerr <= ULP[dt] and same and werr <= 1e-6 and all(res.values())
    return {**res, "ok": ok, "logit_err": lerr, "ids_equal": same, "weight_err": werr}


@pytest.fixture(scope="module")
def interp_results() -> dict:
    return json_results(__file__)


@pytest.mark.parametrize("name", [*CASES, "nan_row"])
def test_interpreter(interp_results: dict, name: str) -> None:
    res = case_result(interp_results, name)
    assert res["ok"], res


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", list(CASES))
def test_gpu(name: str) -> None:
    res = _run_case(name, "cuda", torch.bfloat16)
    assert res["ok"], res
    assert _run_case(name, "cuda", torch.bfloat16, nan=True)["ok"]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("renorm", [False, True])
def test_gpu_block_fused_against_two_steps(monkeypatch, renorm: bool) -> None:
    """SparseMoEBlock.forward at T=1: the fused router gives the two-step path's experts (the same ids for a
    random row: its logits differ at most by a bf16 rounding step) and outputs within bf16 rounding; replayed
    in a CUDA graph on new inputs."""
    import hybridmoe.moe.triton_experts  # noqa: F401  (registers "triton")
    from hybridmoe.moe.experts import ExpertWeights, create_experts
    from hybridmoe.moe.layer import SparseMoEBlock
    from hybridmoe.moe.recorder import ExpertDistributionRecorder, RecordingExperts

    torch.manual_seed(0)
    H, E, K, Isz = 256, 32, 4, 96
    blk = SparseMoEBlock(0, H, E, K, Isz, renormalize=renorm).cuda().to(torch.bfloat16)
    blk.gate.weight.data.normal_(0, H**-0.5)
    gu = torch.randn(E, 2 * Isz, H, device="cuda", dtype=torch.bfloat16) / H**0.5
    dn = torch.randn(E, H, Isz, device="cuda", dtype=torch.bfloat16) / Isz**0.5
    blk.experts = create_experts("triton", ExpertWeights(gu, dn), 0)
    rec = ExpertDistributionRecorder(None, E, torch.device("cuda"), (0,))
    blk.experts = RecordingExperts(blk.experts, rec, 0)  # as the engine installs them: always counting
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    assert blk._fused_router(x, blk.gate)
    fused = blk(x)
    once = rec.counts[0].clone()  # counted by the router launch, once (not again by the wrapper)
    monkeypatch.setenv("HYBRIDMOE_ROUTER_FUSED", "0")
    assert not blk._fused_router(x, blk.gate)
    two = blk(x)
    monkeypatch.delenv("HYBRIDMOE_ROUTER_FUSED")
    assert ((fused.float() - two.float()).abs().max() / two.float().abs().max()).item() <= 2e-2
    assert int(once.sum()) == K and torch.equal(rec.counts[0] - once, once)  # the same K experts either way
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = blk(x)
    for seed in (1, 2, 3):
        x.copy_(torch.randn(1, H, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        monkeypatch.setenv("HYBRIDMOE_ROUTER_FUSED", "0")
        ref = blk(x)
        monkeypatch.delenv("HYBRIDMOE_ROUTER_FUSED")
        torch.cuda.synchronize()
        assert ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item() <= 2e-2
    assert int(blk._ticket.item()) == 0


if __name__ == "__main__" and "--interp" in sys.argv:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    cases = {c: (lambda c=c: _run_case(c)) for c in CASES}
    cases["nan_row"] = lambda: _run_case("h2100_e128_k8_renorm", nan=True)
    print(json.dumps(collect(cases)))
