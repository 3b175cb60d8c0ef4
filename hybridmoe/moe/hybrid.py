"""Hybrid routed experts: the layer's GPU-resident experts on the GPU backend, the rest on the CPU
engine, computed at the same time; optional deferral of each token's lowest-weight CPU experts
to the next MoE layer.

Legend: T tokens, H hidden, E experts of the layer, K top-k, Eg/Ec GPU/CPU experts.

Per forward: the CPU task is submitted first (returns at once), the GPU experts (and, through
`forward_with`, the layer's shared experts) run meanwhile, then the CPU result is waited for and added. With deferral d > 0, each token's d lowest-weight
CPU experts go into a second CPU task, queued after the first; its output is added to the next
MoE layer's output, so the CPU works through the next attention. The last MoE layer defers
nothing and collects what the one before it deferred. The state layers share (the deferral
chain, pinned buffers, the layerwise driver) is the HybridRuntime (moe/runtime.py) each layer is
given; which experts are where is the frozen HybridPlacement (moe/placement.py).

On CUDA the CPU side is driven from the stream (moe/cuda_bridge.py: tasks gated on a word the
stream sets, waits as host functions; capturable in a CUDA graph); on the CPU device from Python
(submit/sync).

Layerwise prefill (--kt-gpu-prefill-token-threshold N): the model runner wraps a forward of T >= N
tokens in the runtime's `forward_scope`, which sets `layerwise_active`; every layer then computes
all its experts on the GPU side, its CPU-resident ones streamed from the CPU engine's packed
weights (moe/layerwise.py). Such a forward defers nothing (it first collects work a previous,
interrupted forward left deferred). With --kt-enable-dynamic-expert-update the CPU engine layer
holds every expert of the layer (cpu_local maps an expert to its row there, -1 when on the GPU),
and after each layerwise prefill the most-used CPU experts of the batch take the GPU slots of
the least-used GPU ones (in place: weights, index tensors and masks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hybridmoe.config import ConfigError
from hybridmoe.cpu.dequant import PackedFormat
from hybridmoe.cuda_driver import page_lock
from hybridmoe.moe.experts import ExpertWeights, MoEExperts, create_experts
from hybridmoe.moe.layerwise import stream_runs, stream_source, swap_hot_experts
from hybridmoe.moe.options import ExpertsOptions
from hybridmoe.moe.runtime import HostDeferred, HybridRuntime, StreamDeferred

if TYPE_CHECKING:
    from hybridmoe.moe.cuda_bridge import StreamCPUTask


def _span(ids: torch.Tensor) -> slice | torch.Tensor:
    """ids as a slice when they are a contiguous range (ExpertWeights.select then gives views), else ids."""
    n = len(ids)
    return slice(int(ids[0]), int(ids[0]) + n) if n and int(ids[-1]) - int(ids[0]) == n - 1 else ids


def _local_index(mask: torch.Tensor) -> torch.Tensor:
    """[E] int32: position of each expert among the selected ones, -1 for the others."""
    idx = torch.full(mask.shape, -1, dtype=torch.int32)
    idx[mask] = torch.arange(int(mask.sum()), dtype=torch.int32)
    return idx


class HybridExperts(MoEExperts):
    name = "hybrid"

    def __init__(self, weights: ExpertWeights, layer_idx: int, options: ExpertsOptions) -> None:
        from hybridmoe.moe.cpu_experts import CPUExperts

        if options.runtime is None:
            raise ValueError("the hybrid experts backend needs ExpertsOptions.runtime")
        rt: HybridRuntime = options.runtime
        placement = rt.placement
        self.runtime, self.layer_idx = rt, layer_idx
        self.options = options
        self.mask = mask = placement.masks[layer_idx].clone()  # [E] host; this layer's own (dynamic update)
        dev = rt.device
        self.hidden = weights.hidden_size
        self.num_experts = weights.num_experts
        self.activation = weights.activation
        # the model dtype (the layerwise buffer's); fp8 experts (a block-scaled checkpoint) are not in it
        self.dtype = options.compute_dtype(dev) if weights.is_fp8 else weights.gate_up.dtype
        self.moe_index = placement.moe_layers.index(layer_idx)
        # with dynamic update the CPU layer holds every expert: cpu_local is an expert's row there
        self.full_cpu_layer = placement.dynamic_update
        self.gpu_local = _local_index(mask).to(dev)  # [E]
        self.cpu_local = (torch.where(mask, -1, torch.arange(len(mask), dtype=torch.int32)) if self.full_cpu_layer
                          else _local_index(~mask)).to(dev)  # [E]
        # slot in the layerwise buffer (CPU-resident experts in expert order); = cpu_local without dynamic update
        self.stream_local = _local_index(~mask).to(dev) if self.full_cpu_layer else self.cpu_local  # [E]
        self.mask_dev = mask.to(dev)  # [E] True = GPU-resident (kept current by dynamic update)
        self.is_first = layer_idx == placement.moe_layers[0]
        self.defer = placement.defer_of(layer_idx, rt.num_deferred)
        gpu_ids, cpu_ids = mask.nonzero().flatten(), (~mask).nonzero().flatten()
        self.num_gpu, self.num_streamed = len(gpu_ids), len(cpu_ids)
        self.gpu: MoEExperts | None = None
        self.gpu_w: ExpertWeights | None = None  # the GPU-resident experts' weights [Eg, ...]
        self._stream_tasks: dict[int, tuple] = {}  # token capacity -> (now, deferred) StreamCPUTasks
        self._streamed: MoEExperts | None = None  # the GPU backend over the layerwise buffer
        self.cpu: CPUExperts | None = None
        self.cpu_lora = None  # lora/cpu_bridge.py CPUExpertLoRA of the CPU share (attached by the LoRA manager)
        if len(gpu_ids):  # only these experts' weights go to the GPU (fp8: with their block scales)
            sel = weights.select(_span(gpu_ids))
            # always a copy of their own: a view of a layer assembled on the GPU would keep all of it alive
            on_dev = [None if t is None else torch.empty(t.shape, dtype=t.dtype, device=dev).copy_(t)
                      for t in (sel.gate_up, sel.down, sel.gate_up_scale, sel.down_scale)]
            self.gpu_w = ExpertWeights(*on_dev[:2], weights.activation, *on_dev[2:], block=sel.block)
            if self.gpu_w.is_fp8 and self.full_cpu_layer:  # dynamic update swaps rows with the model-dtype buffer
                self.gpu_w = self.gpu_w.dequantized(self.dtype)
            self.gpu = create_experts(placement.gpu_backend, self.gpu_w, layer_idx, options)
        if len(cpu_ids):  # only these stay in host memory, packed for the CPU kernels (all with dynamic update)
            host = weights if self.full_cpu_layer else weights.select(_span(cpu_ids))  # fp8: scales follow
            page_align = rt.layerwise is not None and dev.type == "cuda"  # page-locked in place below
            self.cpu = CPUExperts(host, layer_idx, dataclasses.replace(options, page_align=page_align))
            if rt.layerwise is not None:
                packed = self.cpu.layer.packed
                if self.full_cpu_layer and packed.num_experts != self.num_experts:
                    raise ConfigError(f"--kt-enable-dynamic-expert-update: the CPU layer {layer_idx} holds "
                                      f"{packed.num_experts} experts, expected all {self.num_experts}")
                # [E_cpu, ...] host tensors the prefill streams (GGUF: the file's rows, mapped read-only)
                self.fmt, self.packed_parts = stream_source(packed)
                self.runs = stream_runs(mask, self.full_cpu_layer)
                # GGUF rows are the file's read-only mapped pages: registering them (CU_MEMHOSTREGISTER_READ_ONLY)
                # succeeded on the H200 but the H2D copies from them then failed with "invalid argument", so
                # they are copied from pageable memory (correct, slower) until that is understood
                gguf = not isinstance(self.fmt, PackedFormat)
                self.pinned = dev.type != "cuda" or (not gguf and page_lock(packed, list(self.packed_parts.values()),
                                                                            dev))

    def set_defer(self, defer: int) -> None:
        """Deferred experts per token from now on (HybridRuntime.set_num_deferred)."""
        self.defer = defer
        self.drop_stream_tasks()  # their (now, deferred) pairs were built for the old setting

    def drop_stream_tasks(self) -> None:
        """Forget the stream tasks (rebuilt at the next forward with the runtime's settings then)."""
        self._stream_tasks.clear()

    def stream_tasks(self) -> list[StreamCPUTask]:
        """This layer's stream tasks (immediate and deferred, every token capacity)."""
        return [task for pair in self._stream_tasks.values() for task in pair if task is not None]

    def _split(self, ids: torch.Tensor, topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """CPU-local ids [T, K] of the pairs computed now, and of those deferred (None: no deferral);
        -1 marks a pair the task skips. Device ops only (no sync)."""
        return split_deferred(self.cpu_local[ids], topk_weights, self.defer)

    def _gpu_part(self, x: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor,
                  gpu_in: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """[T, H] float32: the GPU experts' share. gpu_in: their (ids, weights) as handoff_triton.handoff made them."""
        if self.gpu is None:
            return torch.zeros(x.shape[0], self.hidden, dtype=torch.float32, device=x.device)
        if gpu_in is None:
            gid = self.gpu_local[ids]
            valid = gid >= 0
            # pairs of CPU experts: expert 0 with weight 0 (cheaper than a ragged batch on the GPU)
            gpu_in = torch.where(valid, gid, 0), torch.where(valid, topk_weights, 0.0)
        return self.gpu.forward(x, *gpu_in).float()

    def _forward_stream(self, x: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor,
                        extra: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """CUDA: the CPU side as stream host functions (capturable)."""
        from hybridmoe.moe.cuda_bridge import StreamCPUTask

        rt, t = self.runtime, x.shape[0]
        if self.is_first:
            rt.lora_staged = False
            if rt.pending is not None:  # left by an interrupted forward: not ours
                rt.collect_pending()
        tasks = None
        gpu_in = None  # the GPU experts' (ids, weights) from the hand-over kernel
        fused = rt.fused_handoff and t <= MAX_HANDOFF_TOKENS  # (a CPU-only server never imports triton)
        if self.cpu is not None:
            cap = 1 << max(0, (t - 1).bit_length())
            tasks = self._stream_tasks.get(cap)
            if tasks is None:
                def io(slot: int):
                    return rt.pinned_io(self.layer_idx, slot, cap, ids.shape[1], self.hidden, x.dtype)

                memops, merge = rt.stream_wait == "memop", rt.merge_deferred
                first = StreamCPUTask(self.cpu.layer, io(0), submitter=rt.submitter, memops=memops, merge=merge)
                # the deferred task reads the immediate one's x and w: one copy of each
                tasks = self._stream_tasks[cap] = (first, StreamCPUTask(
                    self.cpu.layer, io(1), shared_input=io(0), submitter=rt.submitter,
                    memops=memops, merge=merge) if self.defer else None)
            # the tokens' adapter slots: a fixed buffer under graphs (lora/batch.py), copied like x, once a
            # forward (the layers' tasks share the pinned copy; the last MoE layer defers nothing, so no task
            # of this forward reads it once the next forward's first copy lands)
            lora = None
            if self.cpu_lora is not None and not rt.lora_staged:
                lora = self.cpu_lora.index(t)
                rt.lora_staged = True
            if fused:  # one kernel: the pinned inputs, the go word and the GPU experts' inputs
                gpu_in = tasks[0].enqueue_handoff(x, ids, topk_weights, self.cpu_local,
                                                  self.gpu_local if self.gpu is not None else None,
                                                  later=tasks[1], defer=self.defer,
                                                  lora=lora)
            else:
                ids = ids.long()
                now, later = self._split(ids, topk_weights)
                w = topk_weights.float()
                if later is None:
                    tasks[0].enqueue_submit(x, now.int(), w, lora)
                else:  # both tasks queued by one host function
                    tasks[0].enqueue_submit_with(tasks[1], x, now.int(), later.int(), w, lora)
        out = self._gpu_part(x, ids if gpu_in is not None else ids.long(), topk_weights, gpu_in)  # while the CPU works
        side = extra() if extra is not None else None  # the shared experts: also while the CPU works
        pending = rt.pending
        assert pending is None or isinstance(pending, StreamDeferred)
        if fused and tasks is not None and (pending is None or pending.t == t):
            # one kernel: the pinned outputs read over the bus, added, rounded, plus the shared experts
            if pending is not None:  # the previous layer's deferred task ran before this layer's: one wait
                mine, earlier = tasks[0].enqueue_wait_with(pending.task, t)
            else:
                mine, earlier = tasks[0].enqueue_wait(t), None
            rt.pending = StreamDeferred(tasks[1], t) if self.defer else None
            from hybridmoe.moe.handoff_triton import collect

            if side is not None and side.dtype != x.dtype:  # (added as _plus would: after the kernel)
                return _plus(collect(out, mine, earlier, None, x.dtype), side)
            return collect(out, mine, earlier, side, x.dtype)
        if tasks is not None and pending is not None and pending.t == t:
            # the previous layer's deferred task ran before this layer's (in-order pool): one wait
            mine, earlier = tasks[0].enqueue_result_with(pending.task, t, x.device)
            out += mine
            out += earlier
        else:
            if tasks is not None:
                out += tasks[0].enqueue_result(t, x.device)
            if pending is not None:
                out += pending.collect(x.device)
        rt.pending = StreamDeferred(tasks[1], t) if tasks is not None and self.defer else None
        return _plus(out.to(x.dtype), side)

    def _forward_layerwise(self, x: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Every expert on the GPU side: the resident ones, and the CPU-resident ones streamed in and
        dequantized (layerwise.py); the next MoE layer's copy is issued first. Defers nothing."""
        lw = self.runtime.layerwise
        assert lw is not None
        lw.prefetch(self.moe_index)
        lw.prefetch(self.moe_index + 1)  # overlaps this layer's compute
        out = self._gpu_part(x, ids, topk_weights)  # [T, H] f32, while the copy finishes
        if self.cpu is not None:
            w = lw.acquire(self)  # [Ec, 2I, H], [Ec, H, I] views of the shared buffer
            if self._streamed is None:
                self._streamed = create_experts(self.runtime.placement.gpu_backend, w, self.layer_idx, self.options)
            sid = self.stream_local[ids]
            valid = sid >= 0
            # pairs of GPU-resident experts: streamed expert 0 with weight 0 (as in _gpu_part)
            out += self._streamed.forward(x, torch.where(valid, sid, 0), torch.where(valid, topk_weights, 0.0)).float()
            if self.full_cpu_layer and self.gpu_w is not None:  # dynamic expert update
                counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts)  # [E] tokens per expert
                cap = min(self.num_gpu, self.num_streamed)
                rec = swap_hot_experts(counts, self.mask_dev, self.gpu_local, self.cpu_local, self.stream_local,
                                       self.gpu_w, w, cap)
                lw.note_swaps(self, rec)
        return out.to(x.dtype)

    def apply_host_swaps(self, moved: list[tuple[int, int, int, int]]) -> None:
        """After a dynamic update (device side already done): host mask and copy plan."""
        mask = self.mask
        for e_in, e_out, _, _ in moved:
            mask[e_in], mask[e_out] = True, False
        self.runs = stream_runs(mask, self.full_cpu_layer)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.runtime.layerwise_active:
            return self._forward_layerwise(x, topk_ids.long(), topk_weights)
        if _use_stream(x):  # (the hand-over kernel takes the router's ids as they are: no conversion launch)
            return self._forward_stream(x, topk_ids, topk_weights)
        return self._forward_host(x, topk_ids.long(), topk_weights)

    def forward_with(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     extra: Callable[[], torch.Tensor]) -> torch.Tensor:
        """forward + extra(), extra (the shared experts) issued after the CPU task was submitted and
        before it is waited for, so that it runs while the CPU computes."""
        if self.runtime.layerwise_active:  # no CPU task to overlap with
            return self._forward_layerwise(x, topk_ids.long(), topk_weights) + extra()
        if _use_stream(x):
            return self._forward_stream(x, topk_ids, topk_weights, extra)
        return self._forward_host(x, topk_ids.long(), topk_weights, extra)

    def _forward_host(self, x: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor,
                      extra: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """The CPU device: the CPU side submitted and waited for from Python."""
        rt = self.runtime
        if self.is_first and rt.pending is not None:  # left over by an interrupted forward
            rt.collect_pending()
        task = None
        deferred = None
        if self.cpu is not None:
            now, later = self._split(ids, topk_weights)
            x_h = x.detach().to("cpu").contiguous()
            w_h = topk_weights.float().to("cpu").contiguous()
            out_h = torch.empty(x.shape[0], self.hidden, dtype=torch.float32)
            lora_h = (self.cpu_lora.index(x.shape[0]).to("cpu", torch.int32).contiguous()
                      if self.cpu_lora is not None else None)
            task = self.cpu.submit(x_h, now.to("cpu", torch.int32).contiguous(), w_h, out_h, lora_idx=lora_h)
            if later is not None:
                later_out = torch.empty_like(out_h)
                task_later = self.cpu.submit(x_h, later.to("cpu", torch.int32).contiguous(), w_h, later_out,
                                             lora_idx=lora_h)
                deferred = HostDeferred(self.cpu, task_later, later_out)
        out = self._gpu_part(x, ids, topk_weights)
        side = extra() if extra is not None else None  # the shared experts, while the CPU works
        if task is not None:
            self.cpu.sync(task)
            out += out_h.to(x.device)
        if rt.pending is not None:
            out += rt.pending.collect(x.device)
        rt.pending = deferred
        return _plus(out.to(x.dtype), side)


def split_deferred(cid: torch.Tensor, topk_weights: torch.Tensor,
                   defer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """cid [T, K]: CPU-local ids, -1 for GPU experts -> (the pairs computed now, the deferred ones or None
    without deferral), -1 marking a pair a task skips: each token's `defer` lowest-weight CPU pairs are
    deferred, ties by position (handoff_triton.py computes the same in its kernel)."""
    if not defer:
        return cid, None
    on_cpu = cid >= 0
    order = torch.where(on_cpu, topk_weights.float(), float("inf")).argsort(dim=1, stable=True)
    later = torch.zeros_like(on_cpu).scatter_(1, order[:, :defer], True) & on_cpu
    return torch.where(later, -1, cid), torch.where(later, cid, -1)


def _plus(out: torch.Tensor, side: torch.Tensor | None) -> torch.Tensor:
    """The routed output plus the shared experts' (added in the model dtype, as the default
    MoEExperts.forward_with does: the same rounding whichever backend ran)."""
    return out if side is None else out + side


# tokens a layer hands over by handoff_triton.py's kernels; more (prefill chunks) keep the copy engine's path,
# which moves [T, H] faster than one program a token writing over the bus
MAX_HANDOFF_TOKENS = 64


def _use_stream(x: torch.Tensor) -> bool:
    """The CUDA stream path (a test on the CPU emulates the stream by running host functions inline)."""
    return x.is_cuda


def make_hybrid_experts(weights: ExpertWeights, layer_idx: int, options: ExpertsOptions) -> MoEExperts:
    return HybridExperts(weights, layer_idx, options)
