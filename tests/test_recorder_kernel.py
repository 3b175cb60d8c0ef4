"""The expert-distribution recorder's Triton count (moe/recorder_kernel.py) against its torch path.

CPU/CI: the kernel runs under the Triton interpreter in a subprocess (tests/interpreter.py); each case compares
the counts with ExpertDistributionRecorder.record on CPU tensors (index_add_ over the real rows), exactly.
GPU (`-m gpu`): the same on CUDA, and inside a captured graph whose valid-row count changes between replays.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from interpreter import case_result, collect, json_results

# name -> (T, K, E, valid rows or None, ids dtype, layout)
CASES = {
    "t1_k8_e128": (1, 8, 128, None, torch.int64, ""),
    "t37_k6_e20_dups": (37, 6, 20, None, torch.int32, "dups"),
    "t37_k6_e20_valid5": (37, 6, 20, 5, torch.int64, "dups"),
    "t9_k4_e16_valid0": (9, 4, 16, 0, torch.int32, ""),
    "t9_k4_e16_validall": (9, 4, 16, 9, torch.int32, ""),
    "t300_k8_e64_three_programs": (300, 8, 64, 211, torch.int64, ""),
    "t5_k3_e7_strided": (5, 3, 7, None, torch.int64, "strided"),
    "t0_k8_e16": (0, 8, 16, None, torch.int64, ""),
}


def make_ids(T: int, K: int, E: int, dtype: torch.dtype, layout: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if layout == "dups":  # repeats inside rows and a hot expert
        ids = torch.randint(0, min(E, 4), (T, K), generator=g)
    elif T and K <= E:
        ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    else:
        ids = torch.randint(0, E, (T, K), generator=g)
    if layout == "strided":  # a column slice: not contiguous
        ids = torch.cat([ids, ids], dim=1)[:, ::2]
    return ids.to(dtype)


def torch_counts(ids: torch.Tensor, E: int, valid: int | None) -> torch.Tensor:
    """Twice through the recorder's torch path (counts accumulate across calls)."""
    from hybridmoe.moe.recorder import ExpertDistributionRecorder

    rec = ExpertDistributionRecorder(None, E, torch.device("cpu"), (0,))
    for _ in range(2):
        if valid is None:
            rec.record(0, ids)
        else:
            with rec.rows_counted(torch.tensor([valid])):
                rec.record(0, ids)
    return rec.counts[0]


def _run_case(name: str, device: str = "cpu") -> dict:
    from hybridmoe.moe.recorder_kernel import count_experts

    T, K, E, valid, dtype, layout = CASES[name]
    ids = make_ids(T, K, E, dtype, layout, seed=len(name))
    ref = torch_counts(ids, E, valid)
    counts = torch.zeros(E, dtype=torch.int64, device=device)
    vr = torch.tensor([valid], device=device) if valid is not None else None
    for _ in range(2):
        count_experts(counts, ids.to(device), vr)
    return {"equal": torch.equal(counts.cpu(), ref), "got": counts.tolist(), "ref": ref.tolist()}


@pytest.fixture(scope="module")
def interp_results() -> dict:
    return json_results(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_interpreter(interp_results: dict, name: str) -> None:
    res = case_result(interp_results, name)
    assert res["equal"], res


def test_reference_counts_the_real_rows_only() -> None:
    """The torch path itself: 2 passes over 3 real rows of a [5, 2] batch."""
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 3], [0, 0]])
    assert torch_counts(ids, 5, 3).tolist() == [2, 4, 4, 2, 0]
    assert torch_counts(ids, 5, None).tolist() == [6, 4, 4, 6, 0]


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", list(CASES))
def test_gpu(name: str) -> None:
    res = _run_case(name, "cuda")
    assert res["equal"], res


@pytest.mark.gpu
@gpu
def test_gpu_graph_replays_follow_the_valid_rows() -> None:
    from hybridmoe.moe.recorder_kernel import count_experts

    T, K, E = 16, 8, 128
    ids = make_ids(T, K, E, torch.int32, "", 3).cuda()
    counts = torch.zeros(E, dtype=torch.int64, device="cuda")
    valid = torch.tensor([T], device="cuda")
    count_experts(counts, ids, valid)  # compiles outside the capture
    counts.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        count_experts(counts, ids, valid)
    counts.zero_()
    expect = torch.zeros(E, dtype=torch.int64)
    for v in (1, 7, 0, 16):
        valid.fill_(v)
        graph.replay()
        expect += torch.bincount(ids[:v].reshape(-1).long().cpu(), minlength=E)
    torch.cuda.synchronize()
    assert torch.equal(counts.cpu(), expect)


if __name__ == "__main__" and "--interp" in sys.argv:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(json.dumps(collect({c: (lambda c=c: _run_case(c)) for c in CASES})))
