"""CUDA graphs for decode batches: one graph per padded batch size, static input buffers.

Legend: B sequences (padded to a captured size), P pages per sequence, V vocabulary.
Padding rows read and write only the scratch page 0 with a sequence length of 1.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from hybridmoe.layers.attention.base import AttentionMetadata

if TYPE_CHECKING:
    from hybridmoe.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_bs: int) -> None:
        self.runner = runner
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        dev = runner.device
        p = runner.max_pages_per_seq
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.qsl = torch.arange(self.max_bs + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros(self.max_bs, p, dtype=torch.int32, device=dev)
        self.slots = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def can_run(self, bs: int) -> bool:
        return bs <= self.max_bs

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_decode=True, query_start_loc=self.qsl[: bs + 1], seq_lens=self.seq_lens[:bs],
            block_table=self.block_table[:bs], slot_mapping=self.slots[:bs], query_lens_cpu=[1] * bs,
            seq_lens_cpu=[1] * bs, max_seq_len=self.runner.context_len,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        model = self.runner.model
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.sizes):
                ctx = self.runner._ctx(self._meta(bs))
                for _ in range(2):  # warm up: autotuning, lazy init outside the graph
                    model.compute_logits(model(self.input_ids[:bs], self.positions[:bs], ctx))
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    out = model.compute_logits(model(self.input_ids[:bs], self.positions[:bs], ctx))
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[bs], self.outputs[bs] = graph, out
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = meta.num_seqs
        bs = next(b for b in self.sizes if b >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_table[:bs].zero_()
        self.block_table[:n, : meta.block_table.shape[1]].copy_(meta.block_table)
        if bs > n:  # padding rows: scratch page, length 1
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.slots[n:bs].zero_()
            self.seq_lens[n:bs].fill_(1)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
