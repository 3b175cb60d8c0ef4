"""CUDA graphs for decode batches: one graph per padded batch size, static input buffers.

Legend: B sequences (padded to a captured size), P pages per sequence, V vocabulary.
Padding rows read and write only the scratch page 0 with a sequence length of 1.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from hybridmoe.engine.hooks import MoEHooks, NoHooks
from hybridmoe.layers.attention.base import AttentionMetadata

if TYPE_CHECKING:
    from hybridmoe.engine.request import Req
    from hybridmoe.layers.attention.layer import ForwardContext
    from hybridmoe.models.base import MoECausalLM

log = logging.getLogger(__name__)


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class DecodeGraphs:
    """Captured decode forwards (model + logits) per padded batch size.

    The graphs read their inputs from two device buffers (int64: ids, positions, slots; int32: seq
    lens, block table) filled each step from pinned host mirrors by two asynchronous copies, so a
    decode step costs two H2D copies and a replay instead of a dozen small tensors and copies
    (decode at batch 1 is bound by what the host does between replays).

    model: the model to capture; ctx_builder: attention metadata -> the forward context (KV cache,
    backend); hooks: the MoE runtime's capture and before-replay hooks; max_pages: block table width
    per sequence; context_len: the longest sequence."""

    def __init__(self, model: MoECausalLM, device: torch.device, max_bs: int, max_pages: int, context_len: int,
                 ctx_builder: Callable[[AttentionMetadata], ForwardContext], hooks: MoEHooks | None = None) -> None:
        self.model, self.device, self.context_len = model, device, context_len
        self.ctx_builder = ctx_builder
        self.hooks = hooks or NoHooks()
        self.sizes = capture_sizes(max_bs)
        self.max_bs = b = self.sizes[-1]
        dev = device
        self.pages = p = max_pages
        pin = dev.type == "cuda"
        # ids, positions, slots; [3, 0]: the real rows (--record-expert-distribution counts only those)
        self.host64 = torch.zeros(4, b, dtype=torch.int64, pin_memory=pin)
        self.host32 = torch.zeros(b + b * p, dtype=torch.int32, pin_memory=pin)  # seq lens | block table [B, P]
        self.np64, self.np32 = self.host64.numpy(), self.host32.numpy()
        self.dev64 = torch.zeros(4, b, dtype=torch.int64, device=dev)
        self.real_rows = self.dev64[3, :1]  # 0 while capturing: the warm-up and capture forwards count nothing
        self.dev32 = torch.zeros(b + b * p, dtype=torch.int32, device=dev)
        self.input_ids, self.positions, self.slots = self.dev64[0], self.dev64[1], self.dev64[2]
        self.seq_lens = self.dev32[:b]
        self.block_table = self.dev32[b:].view(b, p)
        self.seq_lens.fill_(1)
        self.qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # the logits [max_bs, V], one buffer for every size (each graph's own output would hold its own:
        # ~90 MB over the sizes up to 64 of a 152K vocabulary)
        self.logits: torch.Tensor | None = None
        self.before_replay: dict[int, Callable[[], None]] = {}  # bs -> what the hooks need run before a replay
        self.pool = None
        self.copied = torch.cuda.Event() if pin else None  # the host mirrors may be rewritten after it
        self.lora = None  # lora/manager.py LoRAManager: the per-token adapter slots, a fixed input buffer
        self.future = None  # engine/future.py FutureTokens: resolves placeholder input ids (overlap scheduling)
        self.recorder = None  # moe/recorder.py ExpertDistributionRecorder: counts the real rows of a replay

    def can_run(self, bs: int) -> bool:
        return bs <= self.max_bs

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_decode=True, query_start_loc=self.qsl[: bs + 1], seq_lens=self.seq_lens[:bs],
            block_table=self.block_table[:bs], slot_mapping=self.slots[:bs], query_lens_cpu=[1] * bs,
            seq_lens_cpu=[1] * bs, max_seq_len=self.context_len,
        )

    def _forward(self, bs: int, ctx: ForwardContext) -> torch.Tensor:  # logits [bs, V] in the shared buffer
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], ctx)
        if self.logits is None:  # the first warm-up forward, at the largest size, outside any capture
            logits = self.model.compute_logits(hidden)
            self.logits = torch.empty_like(logits)
            return self.logits.copy_(logits)
        return self.model.compute_logits(hidden, out=self.logits[:bs])

    @torch.inference_mode()
    def capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        counted = self.recorder.rows_counted(self.real_rows) if self.recorder is not None else nullcontext()
        with torch.cuda.stream(stream), counted:
            for bs in reversed(self.sizes):
                ctx = self.ctx_builder(self._meta(bs))
                if self.lora is not None:  # the graph reads the fixed slot index buffer
                    self.lora.batch.set_graph(bs)
                for _ in range(2):  # warm up: autotuning, lazy init outside the graph
                    self._forward(bs, ctx)
                graph = torch.cuda.CUDAGraph()
                # e.g. hybrid MoE layers' gated CPU tasks: recorded here, queued before each replay
                with self.hooks.capture() as record, torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    out = self._forward(bs, ctx)
                if record.before_replay is not None:
                    self.before_replay[bs] = record.before_replay
                if self.pool is None:
                    self.pool = graph.pool()
                assert out.data_ptr() == self.logits.data_ptr()
                self.graphs[bs] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def run(self, reqs: list[Req], page_size: int) -> torch.Tensor:  # logits [n, V]
        """One decode step of `reqs` (one new token each, at position num_computed) through the
        graph of the smallest captured size >= len(reqs). Padding rows read and write only the
        scratch page 0 with a sequence length of 1."""
        n = len(reqs)
        bs = next(b for b in self.sizes if b >= n)
        h64, h32, p = self.np64, self.np32, self.pages
        if self.copied is not None:  # normally long done: the sampled ids were read on the host since
            self.copied.synchronize()
        table = h32[self.max_bs:self.max_bs + bs * p].reshape(bs, p)
        table[:] = 0
        toks = [r.token_at(r.num_computed) for r in reqs]
        pending = min(toks) < 0  # sampled by the step before, not read yet: resolved on the device below
        for i, r in enumerate(reqs):
            pos = r.num_computed
            h64[0, i] = toks[i]
            h64[1, i] = pos
            h64[2, i] = r.pages[pos // page_size] * page_size + pos % page_size
            h32[i] = pos + 1
            table[i, : len(r.pages)] = r.pages
        h64[:3, n:bs] = 0
        h64[3, 0] = n
        h32[n:bs] = 1
        self.dev64.copy_(self.host64, non_blocking=True)  # contiguous: a plain async copy (4 x B ints)
        self.dev32[: self.max_bs + bs * p].copy_(self.host32[: self.max_bs + bs * p], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        if pending:
            self.future.resolve_(self.input_ids[:n], toks)
        if self.lora is not None:  # slots filled (adapters copied in) before the replay; no recapture
            self.lora.prepare_graph(reqs, bs)
        before = self.before_replay.get(bs)
        if before is not None:  # e.g. the graph's CPU tasks, each started by the graph when its inputs land
            before()
        self.graphs[bs].replay()
        return self.logits[:n]
