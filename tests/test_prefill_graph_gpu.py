"""Prefill CUDA graphs (engine/prefill_graph.py) on the GPU: each batch with prompt tokens that a captured graph
takes gives the eager forward's logits, and generation with them equals generation without them."""

from __future__ import annotations

import random

import pytest
import torch

from hybridmoe import LLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    lens = [1, 5, 17, 40, 23, 2, 47, 9, 31, 12, 3, 60]
    ps = [[rng.randrange(1, 200) for _ in range(n)] for n in lens]
    ps.append(ps[3][:33] + [7, 8])  # a cached prefix, then an extend
    return ps


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = []
    for part in (prompts[:10], prompts[10:11], prompts[11:]):  # > 8 sequences, one alone, the rest
        outs += [o["output_ids"] for o in llm.generate(input_ids=part, sampling_params=GREEDY)]
    return outs


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_prefill_graphs_match_eager(tiny_model_dir, dtype, tol):
    path = str(tiny_model_dir("qwen3_moe"))
    opts = dict(device="cuda", dtype=dtype, progress=False, chunked_prefill_size=40, page_size=8,
                max_total_tokens=4096, cuda_graph_max_bs=8, max_running_requests=10)
    prompts = _prompts()
    with LLM(path, cuda_graph_max_prefill_tokens=0, **opts) as llm:
        assert llm.engine.runner.prefill_graphs is None
        want = _generate(llm, prompts)
    with LLM(path, cuda_graph_max_prefill_tokens=48, **opts) as llm:
        runner = llm.engine.runner
        pg = runner.prefill_graphs
        assert pg is not None and pg.use_graphs and sorted(pg.graphs) == [16, 32, 48]
        real_run = pg.run
        replays: list[int] = []

        def checked(batch, page_size):
            runner.prefill_graphs = None  # the eager forward of the same batch first (same KV writes)
            try:
                ref = runner.forward(batch)
            finally:
                runner.prefill_graphs = pg
            got = real_run(batch, page_size)
            assert got.shape == ref.shape
            if ref.numel():  # a first chunk alone samples nothing: no rows
                torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())
            replays.append(batch.total_tokens)
            return got

        pg.run = checked
        got = _generate(llm, prompts)
        assert llm.engine.kv.num_used() == 0
    assert len(replays) >= 4 and max(replays) > 32 and min(replays) <= 16, replays
    if dtype == "float32":
        assert got == want


def test_prefill_graphs_off_where_they_cannot_run(tiny_model_dir):
    opts = dict(device="cuda", progress=False, max_total_tokens=2048, cuda_graph_max_bs=2)
    with LLM(str(tiny_model_dir("deepseek_v2")), **opts) as llm:  # MLA
        assert llm.engine.runner.graphs is not None and llm.engine.runner.prefill_graphs is None
    with LLM(str(tiny_model_dir("qwen3_moe")), dtype="bfloat16", kt_method="BF16", kt_num_gpu_experts=2,
             **opts) as llm:  # hybrid
        assert llm.engine.runner.prefill_graphs is None


def test_expert_distribution_counts_real_tokens(tiny_model_dir, tmp_path):
    """--record-expert-distribution with decode and prefill graphs (padded rows, warm-up and capture forwards)
    counts what an eager run counts."""
    path = str(tiny_model_dir("qwen3_moe"))
    opts = dict(device="cuda", dtype="float32", progress=False, chunked_prefill_size=40, page_size=8,
                max_total_tokens=4096, cuda_graph_max_bs=8, max_running_requests=10)
    prompts = _prompts()[:7]  # 7 sequences: decode batches pad to 8
    counts = []
    for graphs in (False, True):
        with LLM(path, disable_cuda_graph=not graphs, record_expert_distribution=str(tmp_path / f"{graphs}.json"),
                 **opts) as llm:
            assert (llm.engine.runner.prefill_graphs is not None) == graphs
            llm.generate(input_ids=prompts, sampling_params=GREEDY)
            counts.append(llm.engine.runner.recorder.recorded())
    assert counts[0] == counts[1]
