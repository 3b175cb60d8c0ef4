"""CUDA graphs for batches with new prompt tokens (prefill, extend over a cached prefix, prefill mixed with
decode rows): one graph per padded token count, static input buffers.

An eager prefill of a short prompt is bound by the host: ~13 launches a layer at 50-100 us each on the H100
host (a 128-token prompt of Qwen3-30B-A3B: 56 ms to the first token, of which the GPU was busy ~10 ms). A
replay launches them all at once.

Legend: T new tokens (padded to a captured count Tp), B sequence slots (up to `max_seqs` real sequences, then
one padding sequence), P pages per sequence, V vocabulary.

The padded batch: real sequences in slots 0..n-1; empty slots n..B-2 (no new tokens, length 0); the padding
sequence in slot B-1 owns the Tp - T padding tokens, which read and write only the scratch page 0 (its block
table row is all 0). Attention keeps sequences apart, every other op is per token, and the logits rows are
gathered by index: the real tokens' results do not depend on the padding.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from hybridmoe.layers.attention.base import AttentionMetadata

if TYPE_CHECKING:
    from hybridmoe.engine.future import FutureTokens
    from hybridmoe.engine.scheduler import ScheduledBatch
    from hybridmoe.layers.attention.layer import ForwardContext
    from hybridmoe.models.base import MoECausalLM
    from hybridmoe.moe.recorder import ExpertDistributionRecorder

log = logging.getLogger(__name__)



def prefill_capture_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture: 16, 32, 64, then steps of half the previous power of two, up to max_tokens."""
    sizes, t = [], 16
    while t < max_tokens:
        sizes.append(t)
        step = 1 << max(3, (t.bit_length() - 2))  # 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, ...
        t += step if t >= 64 else t
    sizes.append(max_tokens)
    return sorted(set(s for s in sizes if 0 < s <= max_tokens))


class PrefillGraphs:
    """Captured forwards (model + logits of the sampled rows) of batches of up to `max_tokens` new tokens in up to
    `max_seqs` sequences, per padded token count.

    model: the model to capture; ctx_builder: attention metadata -> the forward context; max_pages: block table
    width per sequence; context_len: the longest sequence; pool: a graph memory pool to share (the decode
    graphs'); capture: False builds the same padded batches but runs them eagerly (tests of the padding on
    devices without graphs); recorder: --record-expert-distribution's, which then counts the real tokens only."""

    def __init__(self, model: MoECausalLM, device: torch.device, max_tokens: int, max_seqs: int, max_pages: int,
                 context_len: int, ctx_builder: Callable[[AttentionMetadata], ForwardContext],
                 future: FutureTokens | None = None, pool=None, capture: bool = True,
                 recorder: ExpertDistributionRecorder | None = None) -> None:
        self.model, self.device, self.context_len, self.ctx_builder = model, device, context_len, ctx_builder
        self.sizes = prefill_capture_sizes(max_tokens)
        self.max_tokens = t = self.sizes[-1]
        self.max_seqs = max_seqs
        self.slots = b = max_seqs + 1  # + the padding sequence
        self.pages = p = max_pages
        self.future, self.pool, self.use_graphs = future, pool, capture
        pin = device.type == "cuda"
        # int64: ids, positions, slot mapping [3, T] | logits rows [B - 1] | real tokens [1]; int32: qsl [B + 1] |
        # seq lens [B] | block table [B, P]
        self.n64, self.n32 = 3 * t + (b - 1) + 1, (b + 1) + b + b * p
        self.host64 = torch.zeros(self.n64, dtype=torch.int64, pin_memory=pin)
        self.host32 = torch.zeros(self.n32, dtype=torch.int32, pin_memory=pin)
        self.np64, self.np32 = self.host64.numpy(), self.host32.numpy()
        self.dev64 = torch.zeros(self.n64, dtype=torch.int64, device=device)
        self.dev32 = torch.zeros(self.n32, dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.slot_mapping = (self.dev64[i * t:(i + 1) * t] for i in range(3))
        self.rows = self.dev64[3 * t:3 * t + b - 1]
        self.real_tokens = self.dev64[3 * t + b - 1:]  # [1]; 0 while capturing (--record-expert-distribution)
        self.recorder = recorder
        self.qsl = self.dev32[:b + 1]
        self.seq_lens = self.dev32[b + 1:2 * b + 1]
        self.block_table = self.dev32[2 * b + 1:].view(b, p)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # the sampled rows' logits [B - 1, V], one buffer for every size: each graph's own output would hold
        # 9 x 19 MB at 64 sequences of a 152K vocabulary (the lm_head result is a temporary of the shared pool)
        self.logits: torch.Tensor | None = None
        self.copied = torch.cuda.Event() if pin else None  # the host mirrors may be rewritten after it

    def can_run(self, batch: ScheduledBatch) -> bool:
        """Whether `batch` fits a captured size (new tokens and sequences)."""
        live = sum(1 for n in batch.num_tokens if n > 0)
        return 0 < batch.total_tokens <= self.max_tokens and 0 < live <= self.max_seqs

    def _meta(self, tp: int, q_lens: list[int] | None = None, seq_lens: list[int] | None = None) -> AttentionMetadata:
        """Metadata over the static buffers. Captured graphs take host lists that only bound the grid (the
        kernels read the device tensors); the eager form gets the real lists (the torch backend loops on them)."""
        b = self.slots
        return AttentionMetadata(
            is_decode=False, query_start_loc=self.qsl, seq_lens=self.seq_lens, block_table=self.block_table,
            slot_mapping=self.slot_mapping[:tp], query_lens_cpu=q_lens or [tp] + [0] * (b - 1),
            seq_lens_cpu=seq_lens or [self.context_len] * b, max_seq_len=self.context_len,
        )

    def _forward(self, tp: int, meta: AttentionMetadata) -> torch.Tensor:  # logits [B - 1, V]
        # the expert-distribution recorder counts the real tokens only (none in the warm-up and capture forwards)
        counted = self.recorder.rows_counted(self.real_tokens) if self.recorder is not None else nullcontext()
        with counted:
            hidden = self.model(self.input_ids[:tp], self.positions[:tp], self.ctx_builder(meta))  # [Tp, hidden]
        logits = self.model.compute_logits(hidden.index_select(0, self.rows))
        if self.logits is None:  # first warm-up forward, outside any capture
            self.logits = torch.empty_like(logits)
        return self.logits.copy_(logits)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture a graph per size, largest first (the pool grows once)."""
        if not self.use_graphs:
            return
        self.qsl.zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for tp in reversed(self.sizes):
                self.qsl[-1] = tp  # the padding sequence owns every token while capturing
                self.seq_lens.zero_()
                self.seq_lens[-1] = tp
                meta = self._meta(tp)
                for _ in range(2):  # warm up: Triton compiles, lazy init outside the graph
                    self._forward(tp, meta)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    out = self._forward(tp, meta)
                if self.pool is None:
                    self.pool = graph.pool()
                assert out is self.logits
                self.graphs[tp] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("captured prefill CUDA graphs for %s new tokens (up to %d sequences)", self.sizes, self.max_seqs)

    def run(self, batch: ScheduledBatch, page_size: int) -> torch.Tensor:  # logits [B', V]
        """The forward of `batch` (can_run) through the graph of the smallest captured token count >= its
        tokens: logits of the requests that sample this step, in batch order."""
        live = [(r, n, smp) for r, n, smp in zip(batch.reqs, batch.num_tokens, batch.sample) if n > 0]
        total = sum(n for _, n, _ in live)
        tp = next(s for s in self.sizes if s >= total)
        t, b, p = self.max_tokens, self.slots, self.pages
        h64, h32 = self.np64, self.np32
        if self.copied is not None:  # normally long done: the previous step's results were read since
            self.copied.synchronize()
        ids: list[int] = []
        qsl, lens, rows = [0], [], []
        table = h32[2 * b + 1:].reshape(b, p)
        table[:len(live)] = 0  # rows past the live ones are never read (length 0; the padding row stays 0)
        at = 0
        for i, (r, n, smp) in enumerate(live):
            start = r.num_computed
            ids.extend(r.ids_between(start, start + n))
            pos = range(start, start + n)
            h64[t + at:t + at + n] = pos
            h64[2 * t + at:2 * t + at + n] = [r.pages[j // page_size] * page_size + j % page_size for j in pos]
            table[i, :len(r.pages)] = r.pages
            at += n
            qsl.append(at)
            lens.append(start + n)
            if smp:
                rows.append(at - 1)
        pad = tp - total
        h64[:total] = ids
        h64[total:tp] = 0  # padding: token 0 at positions 0.., slots of the scratch page 0
        h64[t + total:t + tp] = range(pad)
        h64[2 * t + total:2 * t + tp] = [j % page_size for j in range(pad)]
        h64[3 * t:3 * t + len(rows)] = rows
        h64[3 * t + len(rows):3 * t + b - 1] = 0
        h64[3 * t + b - 1] = total
        empty = b - 1 - len(live)
        q_host = qsl + [total] * empty + [tp]  # [B + 1]
        s_host = lens + [0] * empty + [pad]  # [B]
        h32[:b + 1] = q_host
        h32[b + 1:2 * b + 1] = s_host
        self.dev64.copy_(self.host64, non_blocking=True)
        n32 = 2 * b + 1 + len(live) * p  # qsl, seq lens, the live block table rows
        self.dev32[:n32].copy_(self.host32[:n32], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        if ids and min(ids) < 0:  # placeholders of tokens sampled by a step still on the device
            self.future.resolve_(self.input_ids[:total], ids)
        if self.use_graphs:
            self.graphs[tp].replay()
            out = self.logits
        else:
            q_lens = [q_host[i + 1] - q_host[i] for i in range(b)]
            out = self._forward(tp, self._meta(tp, q_lens, s_host))
        return out[:len(rows)]
