"""The Triton batched-LoRA kernels (lora/triton_ops.py) against the reference: on the CPU under the
Triton interpreter (one subprocess with TRITON_INTERPRET=1, as tests/test_triton_moe.py), and on
CUDA (`-m gpu`): bf16, the CUDA-graph contract (the graph reads the slot buffers and the index
buffer; rewriting them changes the output of the next replay without a recapture).

Tolerance (max abs error / max abs reference): fp32 1e-5; bf16 2e-2 (8 mantissa bits)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (the script runs alone under the interpreter)
from interpreter import case_result, collect, json_results

CASES = {"t0": (0, 3, 4, 7, 5), "t1": (1, 1, 2, 9, 3), "odd": (37, 4, 5, 33, 19), "wide": (6, 8, 16, 130, 200),
         "allbase": (5, 2, 3, 16, 16), "split": (3, 3, 48, 700, 130), "loop": (3, 3, 48, 700, 130)}
# "split": K over 11 chunks of one BLOCK_K step (a partial last one); "loop": as few programs as
# possible (triton_ops._SHRINK_PROGRAMS patched): 2 chunks of 6 steps each (the long-prefill loop)
_PROGRAMS = {"loop": 4}


def _inputs(t, s, r, k, n, dtype, device, seed=0, none=False):
    g = torch.Generator().manual_seed(seed)
    x, a, bt = torch.randn(t, k, generator=g), torch.randn(s, r, k, generator=g), torch.randn(s, r, n, generator=g)
    scale = torch.rand(s, generator=g) + 0.5
    idx = torch.full((t,), -1, dtype=torch.int32) if none else torch.randint(-1, s, (t,), generator=g, dtype=torch.int32)
    y = torch.randn(t, n, generator=g)
    return [v.to(device) for v in (x.to(dtype), a.to(dtype), bt.to(dtype), scale, idx, y.to(dtype))]


def _case(name: str, dtype: torch.dtype, device: str) -> dict:
    from hybridmoe.lora import triton_ops
    from hybridmoe.lora.ops import lora_delta_ref
    from hybridmoe.lora.triton_ops import lora_add

    triton_ops._SHRINK_PROGRAMS = _PROGRAMS.get(name, 256)
    t, s, r, k, n = CASES[name]
    x, a, bt, scale, idx, y = _inputs(t, s, r, k, n, dtype, device, none=name == "allbase")
    want = y.double().cpu() + lora_delta_ref(x.cpu(), a.cpu(), bt.cpu(), scale.cpu(), idx.cpu())
    got = lora_add(y.clone(), x, a, bt, scale, idx).double().cpu()
    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30) if t else 0.0
    return {"err": err, "shape": list(got.shape)}


def _ext_case(name: str, dtype: torch.dtype, device: str) -> dict:
    """lora_expand_ext on a GEMM against [W; A] (every slot's A stacked under W): the base part plus each
    token's own slot's delta, as lora_add gives on the base output."""
    from hybridmoe.lora.ops import lora_delta_ref
    from hybridmoe.lora.triton_ops import lora_expand_ext

    t, s, r, k, n = CASES[name]
    x, a, bt, scale, idx, _ = _inputs(t, s, r, k, n, dtype, device, none=name == "allbase")
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(9)).to(dtype).to(device)
    y_ext = x @ torch.cat([w, a.reshape(s * r, k)]).t()  # [T, N + S*R]
    got = lora_expand_ext(y_ext, n, bt, scale, idx).double().cpu()
    want = (x.double() @ w.double().t()).cpu() + lora_delta_ref(x.cpu(), a.cpu(), bt.cpu(), scale.cpu(), idx.cpu())
    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30) if t else 0.0
    return {"err": err, "shape": list(got.shape)}


def _linear_case(fused: bool, t: int, device: str, dtype: torch.dtype = torch.float32) -> dict:
    """LoRALinear (q/k/v-style parts, a bias) with two adapters in 3 slots and a cleared one: the forward
    against the merged reference; fused: the extended-weight form at both T <= FUSED_MAX_T (one GEMM and the
    expand) and above it (the base weight view, the shrink and the expand over the same A buffer)."""
    from hybridmoe.lora import linear as L
    from hybridmoe.lora.batch import LoRABatch

    g = torch.Generator().manual_seed(t)
    k, parts, slots, rank = 40, (24, 8, 8), 3, 4
    base = torch.nn.Linear(k, sum(parts), bias=True).to(dtype).to(device)
    w0, b0 = base.weight.detach().clone(), base.bias.detach().clone()
    batch = LoRABatch(torch.device(device))
    lin = L.LoRALinear(base, k, parts, slots, rank, batch, dtype, torch.device(device), fused=fused)
    assert lin.fused == fused and torch.equal(lin.base.weight, w0)
    adapters = {}
    for slot in (0, 2):
        ps = {p: (torch.randn(r, k, generator=g), torch.randn(parts[p], r, generator=g), 0.5 + slot)
              for p, r in ((0, 4), (2, 3))}
        adapters[slot] = ps
        lin.set_slot(slot, {p: (a.to(dtype).to(device), b.to(dtype).to(device), sc) for p, (a, b, sc) in ps.items()})
    lin.set_slot(1, {1: (torch.ones(2, k).to(dtype).to(device), torch.ones(8, 2).to(dtype).to(device), 1.0)})
    lin.clear_slot(1)  # a cleared slot: the base model
    x = torch.randn(t, k, generator=g)
    idx = torch.randint(-1, slots, (t,), generator=g, dtype=torch.int32)
    batch.set(idx.tolist())
    got = lin(x.to(dtype).to(device)).double().cpu()
    want = x.double() @ w0.double().cpu().t() + b0.double().cpu()
    for i in range(t):
        for p, (a, b, sc) in adapters.get(int(idx[i]), {}).items():
            o = sum(parts[:p])
            want[i, o:o + parts[p]] += sc * (b.double() @ (a.double() @ x[i].double()))
    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30) if t else 0.0
    return {"err": err, "shape": list(got.shape)}


LINEAR_CASES = {"fused-t1": (True, 1), "fused-t7": (True, 7), "fused-long": (True, 600), "plain-t5": (False, 5),
                "fused-t0": (True, 0)}


def _interp_main() -> None:
    cases = {f"{c}-fp32": (lambda c=c: _case(c, torch.float32, "cpu")) for c in CASES}
    cases.update({f"ext-{c}-fp32": (lambda c=c: _ext_case(c, torch.float32, "cpu")) for c in CASES})
    cases.update({f"linear-{c}": (lambda c=c: _linear_case(*LINEAR_CASES[c], "cpu")) for c in LINEAR_CASES})
    print(json.dumps(collect(cases)))


@pytest.fixture(scope="module")
def interp():
    return json_results(__file__)


@pytest.mark.parametrize("case", sorted(CASES))
def test_interpreted(interp, case):
    res = case_result(interp, f"{case}-fp32")
    assert res["err"] <= 1e-5 and res["shape"] == [CASES[case][0], CASES[case][4]]


@pytest.mark.parametrize("case", sorted(CASES))
def test_interpreted_expand_ext(interp, case):
    res = case_result(interp, f"ext-{case}-fp32")
    assert res["err"] <= 1e-5 and res["shape"] == [CASES[case][0], CASES[case][4]]


@pytest.mark.parametrize("case", sorted(LINEAR_CASES))
def test_interpreted_linear(interp, case):
    res = case_result(interp, f"linear-{case}")
    assert res["err"] <= 1e-5 and res["shape"] == [LINEAR_CASES[case][1], 40]


def test_fused_form_only_where_it_pays():
    """can_fuse: CUDA, a plain bf16/fp16 nn.Linear of the slots' dtype, the stacked A rows at most 1/8 of its rows."""
    from hybridmoe.lora.linear import can_fuse

    lin = torch.nn.Linear(64, 256).to(torch.bfloat16)
    assert not can_fuse(lin, 32, torch.bfloat16, torch.device("cpu"))
    if torch.cuda.is_available():
        cu = lin.cuda()
        assert can_fuse(cu, 32, torch.bfloat16, cu.weight.device)
        assert not can_fuse(cu, 33, torch.bfloat16, cu.weight.device)
        assert not can_fuse(cu, 32, torch.float16, cu.weight.device)


@pytest.mark.parametrize("t, k, r, want", [(1, 2048, 48, (64, 64, 32)), (1, 4096, 16, (256, 256, 16)),
                                           (4, 2048, 32, (128, 128, 16)), (1, 100, 16, (256, 256, 1)),
                                           (512, 2048, 16, (256, 2048, 1)), (100, 700, 48, (64, 256, 3))])
def test_split_k(t, k, r, want):
    """The shrink's K chunks: whole BLOCK_K steps covering K, about 256 programs at decode, 1 chunk
    for a long prefill."""
    from hybridmoe.lora.triton_ops import split_k

    block_r = max(16, 1 << (r - 1).bit_length())
    block_k, per, chunks = split_k(t, k, block_r)
    assert (block_k, per, chunks) == want
    assert per % block_k == 0 and (chunks - 1) * per < k <= chunks * per


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda(case, dtype):
    res = _case(case, dtype, "cuda")
    assert res["err"] <= (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_expand_ext(case, dtype):
    res = _ext_case(case, dtype, "cuda")
    assert res["err"] <= (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(LINEAR_CASES))
def test_cuda_linear_bf16(case):
    """The fused form where it is chosen by itself (bf16 on CUDA) and forced off."""
    fused, t = LINEAR_CASES[case]
    if fused:
        from hybridmoe.lora.linear import can_fuse

        assert can_fuse(torch.nn.Linear(40, 40).to(torch.bfloat16).cuda(), 5, torch.bfloat16, torch.device("cuda"))
    res = _linear_case(fused, t, "cuda", torch.bfloat16)
    assert res["err"] <= 2e-2


@pytest.mark.gpu
def test_cuda_graph_reads_the_buffers():
    from hybridmoe.lora.ops import lora_delta_ref
    from hybridmoe.lora.triton_ops import lora_add

    x, a, bt, scale, idx, y = _inputs(4, 3, 8, 64, 96, torch.float32, "cuda", seed=3)
    out = torch.empty_like(y)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out.copy_(lora_add(y.clone(), x, a, bt, scale, idx))
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(lora_add(y.clone(), x, a, bt, scale, idx))
    for seed in (5, 6):  # new adapters copied into the slots, new per-token slots: replay, no recapture
        _, a2, bt2, scale2, idx2, _ = _inputs(4, 3, 8, 64, 96, torch.float32, "cuda", seed=seed)
        a.copy_(a2), bt.copy_(bt2), scale.copy_(scale2), idx.copy_(idx2)
        graph.replay()
        want = y.double().cpu() + lora_delta_ref(x.cpu(), a.cpu(), bt.cpu(), scale.cpu(), idx.cpu())
        assert torch.allclose(out.double().cpu(), want, rtol=1e-4, atol=1e-4)


if __name__ == "__main__" and "--interp" in sys.argv:
    _interp_main()
