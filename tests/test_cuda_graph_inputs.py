"""The decode graphs' input filling (pinned host mirrors -> static device buffers) gives the
graph the same ids, positions, KV slots, sequence lengths and block table as the eager path's
prepare(), with padding rows on the scratch page. Runs on the CPU: the graph replay is replaced by
a stand-in that records the static buffers (the real replay is covered by the GPU tests)."""

from __future__ import annotations

import random

import torch

from hybridmoe import LLM
from hybridmoe.engine.cuda_graph import DecodeGraphs
from hybridmoe.engine.request import Req, SamplingParams
from hybridmoe.engine.scheduler import ScheduledBatch


class _Recorder:
    def __init__(self, graphs: DecodeGraphs, bs: int) -> None:
        self.graphs, self.bs = graphs, bs

    def replay(self) -> None:
        g = self.graphs
        g.seen = (self.bs, g.input_ids[: self.bs].clone(), g.positions[: self.bs].clone(), g.slots[: self.bs].clone(),
                  g.seq_lens[: self.bs].clone(), g.block_table[: self.bs].clone())
        g.seen_real = int(g.real_rows[0])


def test_graph_inputs_match_prepare():
    llm = LLM(device="cpu", progress=False)  # the demo model: only its runner's shapes matter here
    runner = llm.engine.runner
    s = runner.page_size
    graphs = runner.new_graphs(8)
    for bs in graphs.sizes:
        graphs.graphs[bs] = _Recorder(graphs, bs)
    graphs.logits = torch.arange(graphs.max_bs * 3, dtype=torch.float32).view(graphs.max_bs, 3)  # the shared buffer
    rng = random.Random(0)
    free = list(range(1, runner.num_pages))
    rng.shuffle(free)
    for n in (1, 3, 5, 8, 2):  # sizes that pad (3 -> 4, 5 -> 8) and shrink after a larger batch
        reqs = []
        for _ in range(n):
            prompt = [rng.randrange(100) for _ in range(rng.randrange(1, 40))]
            out = [rng.randrange(100) for _ in range(rng.randrange(0, 30))]
            r = Req(rid=str(rng.random()), prompt_ids=prompt, params=SamplingParams(), output_ids=out)
            r.num_computed = len(prompt) + len(out) - 1  # the last token is the new one
            r.pages = [free.pop() for _ in range(-(-(r.num_computed + 1) // s))]
            reqs.append(r)
        batch = ScheduledBatch(reqs=reqs, num_tokens=[1] * n, sample=[True] * n)
        ids, pos, meta, _ = runner.prepare(batch)
        logits = graphs.run(reqs, s)
        bs, g_ids, g_pos, g_slots, g_lens, g_table = graphs.seen
        assert bs == next(b for b in graphs.sizes if b >= n) and logits.shape[0] == n
        assert logits.data_ptr() == graphs.logits.data_ptr()  # rows 0..n-1 of the buffer every graph writes
        assert graphs.seen_real == n  # the expert-distribution recorder counts these rows only
        assert torch.equal(g_ids[:n], ids) and torch.equal(g_pos[:n], pos)
        assert torch.equal(g_slots[:n], meta.slot_mapping) and torch.equal(g_lens[:n], meta.seq_lens)
        w = meta.block_table.shape[1]
        assert torch.equal(g_table[:n, :w], meta.block_table) and not g_table[:n, w:].any()
        # padding rows: token 0 at position 0 into slot 0 of the scratch page, length 1
        assert not g_ids[n:].any() and not g_pos[n:].any() and not g_slots[n:].any() and not g_table[n:].any()
        assert bool((g_lens[n:] == 1).all())
        for r in reqs:
            free.extend(r.pages)
    llm.shutdown()


@torch.inference_mode()  # as the engine runs it
def test_compute_logits_into_a_buffer():
    """compute_logits(out=): the lm_head's GEMM written into the given rows, equal to the plain call; a head
    that is not a plain bias-free Linear (here one with a bias) goes through a copy, equal too."""
    llm = LLM(device="cpu", progress=False)
    model = llm.engine.runner.model
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, model.lm_head.in_features, generator=g).to(model.lm_head.weight.dtype)
    buf = torch.full((7, model.lm_head.out_features), float("nan"), dtype=hidden.dtype)
    want = model.compute_logits(hidden)
    got = model.compute_logits(hidden, out=buf[:5])
    assert got.data_ptr() == buf.data_ptr() and torch.equal(got, want) and buf[5:].isnan().all()
    head = torch.nn.Linear(model.lm_head.in_features, 11, bias=True).to(hidden.dtype)
    model.lm_head, plain = head, model.lm_head
    try:
        out = torch.empty(5, 11, dtype=hidden.dtype)
        assert model.compute_logits(hidden, out=out) is out and torch.equal(out, head(hidden))
    finally:
        model.lm_head = plain
