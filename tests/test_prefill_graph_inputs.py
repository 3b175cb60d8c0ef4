"""The prefill graphs' padded batches (engine/prefill_graph.py) give the eager path's logits. Runs on the CPU with
the padded batches run eagerly (capture=False): the same static buffers, padding sequence, empty sequence slots
and logits rows a captured graph reads; the graph replay itself is covered by tests/test_prefill_graph_gpu.py."""

from __future__ import annotations

import random

import pytest
import torch

from hybridmoe import LLM
from hybridmoe.config import ConfigError, EngineArgs
from hybridmoe.engine.prefill_graph import prefill_capture_sizes


def test_capture_sizes():
    assert prefill_capture_sizes(512) == [16, 32, 64, 96, 128, 192, 256, 384, 512]
    assert prefill_capture_sizes(100) == [16, 32, 64, 96, 100]
    assert prefill_capture_sizes(8) == [8]
    assert prefill_capture_sizes(16) == [16]


def test_flag_bounds():
    with pytest.raises(ConfigError, match="cuda-graph-max-prefill-tokens"):
        EngineArgs.from_kwargs(cuda_graph_max_prefill_tokens=-1)
    with pytest.raises(ConfigError, match="cuda-graph-max-prefill-tokens"):
        EngineArgs.from_kwargs(cuda_graph_max_prefill_tokens=1 << 20)


@pytest.mark.parametrize("limits,pages,sizes", [
    (dict(max_total_tokens=144), 9, [16, 32, 64, 96, 128, 144]),
    (dict(max_total_tokens=4096, context_length=200), 13, [16, 32, 64, 96, 128, 192, 208]),
], ids=["kv_cache", "context_length"])
def test_capture_fits_a_small_kv_cache(limits: dict, pages: int, sizes: list[int]):
    """A sequence that addresses fewer tokens than --cuda-graph-max-prefill-tokens (512) -- a small KV cache (9
    pages of 16), or a short --context-length (200 tokens: 13 pages) -- the capture
    sizes stop at the tokens a sequence can address, and the capture-time forward, whose padding sequence owns
    every token, runs at the largest. Before, the sizes went to 512: the padding sequence's block-table row was
    read past its end, garbage page ids on the GPU (CUBLAS_STATUS_EXECUTION_FAILED at startup, H100 host, session
    31); the CPU's torch attention did not fault, so the sizes are what this test checks."""
    with LLM(device="cpu", dtype="float32", progress=False, max_running_requests=1, cuda_graph_max_bs=1,
             cuda_graph_max_prefill_tokens=512, **limits) as llm:
        runner = llm.engine.runner
        assert runner.max_pages_per_seq == pages
        pg = runner.new_prefill_graphs(capture=False)
        assert pg.sizes == sizes and pg.max_tokens == sizes[-1] == pages * runner.page_size
        tp = pg.sizes[-1]
        pg.qsl.zero_()
        pg.qsl[-1] = tp  # as capture() sets the padding sequence
        pg.seq_lens.zero_()
        pg.seq_lens[-1] = tp
        logits = pg._forward(tp, pg._meta(tp))
        assert logits.shape[0] == pg.max_seqs and bool(torch.isfinite(logits).all())


def _prompts(rng: random.Random) -> list[list[int]]:
    lens = [1, 5, 17, 40, 23, 2, 47, 9, 31, 12, 3, 60]  # 47 and 60 take two chunks of 40
    ps = [[rng.randrange(1, 200) for _ in range(n)] for n in lens]
    ps.append(ps[3][:33] + [7, 8])  # a cached prefix (two full pages of 16) then an extend
    return ps


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_padded_prompt_batches_match_eager(overlap: bool):
    """Every batch with prompt tokens that fits is run both ways: eager, and padded through the static buffers;
    logits agree to fp32 rounding, and the generated tokens (padded results fed back) equal an eager run's."""
    opts = dict(device="cpu", dtype="float32", progress=False, chunked_prefill_size=40, max_running_requests=10,
                cuda_graph_max_bs=8, cuda_graph_max_prefill_tokens=48, enable_overlap_schedule=overlap)
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    prompts = _prompts(random.Random(3))
    with LLM(**opts) as llm:
        want = [o["output_ids"] for o in llm.generate(input_ids=prompts, sampling_params=params)]
    with LLM(**opts) as llm:
        runner = llm.engine.runner
        assert runner.prefill_graphs is None  # the CPU device captures nothing
        pg = runner.new_prefill_graphs(capture=False)
        assert pg is not None and pg.sizes == [16, 32, 48] and pg.max_seqs == 8
        eager = runner.forward
        seen: list[tuple[int, int, int]] = []
        eager_only: list[tuple[int, int]] = []

        def both(batch):
            ref = eager(batch)
            if batch.is_decode or not pg.can_run(batch):
                if not batch.is_decode:
                    eager_only.append((batch.total_tokens, sum(1 for n in batch.num_tokens if n > 0)))
                return ref
            got = pg.run(batch, runner.page_size)
            assert got.shape == ref.shape
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
            live = sum(1 for n in batch.num_tokens if n > 0)
            seen.append((batch.total_tokens, live, sum(batch.sample)))
            return got

        runner.forward = both
        first = llm.generate(input_ids=prompts[:10], sampling_params=params)
        alone = llm.generate(input_ids=prompts[10:11], sampling_params=params)  # 3 tokens: the size 16
        rest = llm.generate(input_ids=prompts[11:], sampling_params=params)
        got = [o["output_ids"] for o in first + alone + rest]
    assert got == want
    assert any(live > 1 for _, live, _ in seen), seen  # prompts beside other sequences
    assert any(smp < live for _, live, smp in seen), seen  # a first chunk among them: not sampled
    assert {tp for tp in (next(s for s in pg.sizes if s >= t) for t, _, _ in seen)} == {16, 32, 48}, seen
    assert eager_only and all(t > 48 or live > 8 for t, live in eager_only), eager_only  # larger ones stay eager


def test_recorder_counts_only_real_rows():
    from hybridmoe.moe.recorder import ExpertDistributionRecorder

    rec = ExpertDistributionRecorder(None, 6)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [0, 0]])
    with rec.rows_counted(torch.tensor([3])):  # the last row is padding
        rec.record(0, ids)
    assert rec.recorded()[0] == [1, 1, 1, 1, 1, 1]
    rec.record(0, ids)  # an eager forward: every row
    assert rec.recorded()[0] == [4, 2, 2, 2, 2, 2]


def test_expert_distribution_ignores_padding(tmp_path):
    """--record-expert-distribution with prompt batches through the padded path: the same counts as eager
    (the padding tokens and the warm-up forwards count nothing)."""
    opts = dict(device="cpu", dtype="float32", progress=False, chunked_prefill_size=40, max_running_requests=10,
                cuda_graph_max_prefill_tokens=48)
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    prompts = _prompts(random.Random(4))[:7]
    counts = []
    for padded in (False, True):
        with LLM(record_expert_distribution=str(tmp_path / f"d{padded}.json"), **opts) as llm:
            runner = llm.engine.runner
            if padded:
                pg = runner.new_prefill_graphs(capture=False)
                eager = runner.forward
                used = []

                def forward(batch, pg=pg, eager=eager, used=used, page=runner.page_size):
                    if batch.is_decode or not pg.can_run(batch):
                        return eager(batch)
                    used.append(batch.total_tokens)
                    return pg.run(batch, page)

                runner.forward = forward
            llm.generate(input_ids=prompts, sampling_params=params)
            counts.append(runner.recorder.recorded())
    assert used and any(next(s for s in pg.sizes if s >= t) > t for t in used)  # padding was there
    assert counts[0] == counts[1] and sum(counts[0][min(counts[0])]) > 0
