"""Expert LoRA through the fused Triton MoE kernels (moe/triton_moe_kernels.fused_moe's delta hook)
against the torch experts backend with the same slots (moe/torch_experts.py, itself tested against
merged weights in test_lora_offline.py): under the Triton interpreter on the CPU (fp32) and on CUDA
(`-m gpu`: bf16, and a CUDA graph that reads rewritten slots and per-token slots without a recapture).

Cases: T = 0 and 1, odd sizes, tokens on no adapter (-1), ranks below the slot's, pairs of weight 0 (the
other side's experts in a hybrid layer). Tolerance (max abs error / max abs reference): fp32 1e-5, bf16 3e-2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (the script runs alone under the interpreter)
from interpreter import case_result, collect, json_results

# name: (T, E, K, H, I, slots, max rank)
CASES = {"t0": (0, 4, 2, 32, 48, 2, 8), "t1": (1, 5, 2, 40, 24, 3, 4), "odd": (37, 7, 3, 72, 40, 3, 8),
         "k1": (9, 4, 1, 32, 32, 2, 16), "allbase": (6, 4, 2, 32, 32, 2, 4),
         "split": (3, 4, 2, 600, 300, 2, 8), "loop": (3, 4, 2, 600, 300, 2, 8)}
# "split": the shrinks over 3 and 2 K chunks (partial last ones); "loop": as few programs as possible
# (triton_ops._SHRINK_PROGRAMS patched): one chunk of several BLOCK_K steps (the long-prefill loop)
_PROGRAMS = {"loop": 1}


def _setup(name: str, dtype: torch.dtype, device: str, seed: int = 0):
    from hybridmoe.lora.batch import LoRABatch
    from hybridmoe.lora.experts import ExpertLoRASlots
    from hybridmoe.moe.experts import ExpertWeights
    from hybridmoe.moe.torch_experts import TorchExperts
    from hybridmoe.moe.triton_experts import TritonExperts

    t, e, k, h, i, s, r = CASES[name]
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype).to(device)
    down = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype).to(device)
    batch = LoRABatch(torch.device(device))
    slots = ExpertLoRASlots(torch.arange(e), s, r, h, i, batch, dtype, torch.device(device))
    fill_slots(slots, g, s, r)
    x = torch.randn(t, h, generator=g).to(dtype).to(device)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)] or [torch.zeros(0, k, dtype=torch.long)])
    ids = ids.reshape(t, k).to(torch.int32)
    w = torch.rand(t, k, generator=g)
    if t > 2:
        w[::3, 0] = 0.0  # the other side's experts in a hybrid layer: weight 0 (ids 0)
        ids[::3, 0] = 0
    idx = torch.full((t,), -1, dtype=torch.int32) if name == "allbase" else torch.randint(-1, s, (t,), generator=g,
                                                                                          dtype=torch.int32)
    batch.current = idx.to(device)
    tri = TritonExperts(ExpertWeights(gate_up, down), 0)
    ref = TorchExperts(ExpertWeights(gate_up, down))
    tri.lora = ref.lora = slots
    return tri, ref, slots, batch, x, ids.to(device), w.to(device)


def fill_slots(slots, g: torch.Generator, s: int, r: int) -> None:
    """Random adapters, each slot with its own rank <= r (zero past it, as set_slot leaves them)."""
    for j in range(s):
        rank = max(1, r - j)
        for n, buf in enumerate(slots.buffers()):
            v = torch.zeros_like(buf[j])
            if n % 2 == 0:  # A [E, R, in]
                v[:, :rank] = torch.randn(v[:, :rank].shape, generator=g).to(v.dtype) / v.shape[-1] ** 0.5
            else:  # B [E, out, R]
                v[:, :, :rank] = torch.randn(v[:, :, :rank].shape, generator=g).to(v.dtype)
            buf[j].copy_(v)
        slots.scale[j] = 0.5 + j


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.numel() == 0:
        return 0.0
    return (got.double().cpu() - want.double().cpu()).abs().max().item() / max(want.abs().max().item(), 1e-30)


def _case(name: str, dtype: torch.dtype, device: str) -> dict:
    from hybridmoe.lora import triton_ops

    triton_ops._SHRINK_PROGRAMS = _PROGRAMS.get(name, 256)
    tri, ref, slots, _, x, ids, w = _setup(name, dtype, device)
    got, want = tri.forward(x, ids, w), ref.forward(x, ids, w)
    tri.lora = ref.lora = None  # the adapters change the result (the test can fail)
    base = ref.forward(x, ids, w)
    return {"err": _err(got, want), "shape": list(got.shape), "delta": _err(base, want) if x.shape[0] else 1.0}


def _interp_main() -> None:
    print(json.dumps(collect({f"{c}-fp32": (lambda c=c: _case(c, torch.float32, "cpu")) for c in CASES})))


@pytest.fixture(scope="module")
def interp():
    return json_results(__file__)


@pytest.mark.parametrize("case", sorted(CASES))
def test_interpreted(interp, case):
    res = case_result(interp, f"{case}-fp32")
    assert res["err"] <= 1e-5 and res["shape"] == [CASES[case][0], CASES[case][3]]
    if case != "allbase":
        assert res["delta"] > 1e-3  # the adapters moved the output
    else:
        assert res["delta"] == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda(case, dtype):
    res = _case(case, dtype, "cuda")
    assert res["err"] <= (1e-5 if dtype == torch.float32 else 3e-2), res


@pytest.mark.gpu
def test_cuda_graph_reads_rewritten_slots_and_index():
    tri, ref, slots, batch, x, ids, w = _setup("odd", torch.bfloat16, "cuda", seed=2)
    idx = batch.current.clone()
    batch.current = idx  # the graph's fixed index buffer
    out = torch.empty_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out.copy_(tri.forward(x, ids, w))
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(tri.forward(x, ids, w))
    for seed in (5, 6):
        g = torch.Generator().manual_seed(seed)
        fill_slots(slots, g, slots.scale.shape[0], slots.gate_A.shape[2])
        idx.copy_(torch.randint(-1, slots.scale.shape[0], idx.shape, generator=g, dtype=torch.int32))
        graph.replay()
        assert _err(out, ref.forward(x, ids, w)) <= 3e-2


if __name__ == "__main__" and "--interp" in sys.argv:
    _interp_main()
