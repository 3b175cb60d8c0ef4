"""Hybrid routed experts: the layer's GPU-resident experts on the GPU backend, the rest on the CPU
engine, computed at the same time; optional deferral of each token's lowest-weight CPU experts
to the next MoE layer.

Legend: T tokens, H hidden, E experts of the layer, K top-k, Eg/Ec GPU/CPU experts.

Per forward: the CPU task is submitted first (returns at once), the GPU experts run meanwhile,
then the CPU result is waited for and added. With deferral d > 0, each token's d lowest-weight
CPU experts go into a second CPU task, queued after the first; its output is added to the next
MoE layer's output, so the CPU works through the next attention. The last MoE layer defers
nothing and collects what the one before it deferred.

Two ways to drive the CPU side: from Python (submit/sync; the CPU device, and CUDA with
HYBRIDMOE_STREAM_HOST_FUNCTIONS=0), or from the CUDA stream (moe/cuda_bridge.py: tasks gated on a
word the stream sets, waits as host functions; capturable in a CUDA graph; the default on CUDA,
validated on the H200).

Layerwise prefill (--kt-gpu-prefill-token-threshold N): the model runner wraps a forward of T >= N
tokens in `HybridPlan.layerwise_forward`, which sets `layerwise_active`; every layer then computes
all its experts on the GPU side, its CPU-resident ones streamed from the CPU engine's packed
weights (moe/layerwise.py). Such a forward defers nothing (it first collects work a previous,
interrupted forward left deferred). With --kt-enable-dynamic-expert-update the CPU engine layer
holds every expert of the layer (cpu_local maps an expert to its row there, -1 when on the GPU),
and after each layerwise prefill the most-used CPU experts of the batch take the GPU slots of
the least-used GPU ones (in place: weights, index tensors and masks).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from hybridmoe.config import ConfigError, EngineArgs
from hybridmoe.moe.experts import ExpertWeights, MoEExperts, create_experts, register_experts_backend
from hybridmoe.moe.layerwise import (
    LayerwisePrefill,
    PackedFormat,
    packed_parts,
    page_lock,
    stream_runs,
    swap_hot_experts,
)
from hybridmoe.moe.placement import gpu_experts_per_layer, place_experts

log = logging.getLogger(__name__)

# CUDA runs drive the CPU side as stream host functions (capturable in CUDA graphs) unless
# HYBRIDMOE_STREAM_HOST_FUNCTIONS=0 asks for the Python-driven path (then the runner keeps CUDA
# graphs off for hybrid models).
USE_STREAM_HOST_FUNCTIONS = os.environ.get("HYBRIDMOE_STREAM_HOST_FUNCTIONS", "1") != "0"


@dataclass
class _Deferred:
    experts: MoEExperts  # the CPU experts that own the task
    task: int
    out: torch.Tensor  # [T, H] float32 host


@dataclass
class HybridPlan:
    """The split of every MoE layer, decided once from the flags, shared by all layers."""

    masks: dict[int, torch.Tensor]  # layer -> [E] bool, True = on the GPU
    moe_layers: list[int]
    num_deferred: int
    gpu_backend: str
    device: torch.device
    pending: _Deferred | None = field(default=None, repr=False)  # deferred work of the previous layer
    pending_stream: tuple | None = field(default=None, repr=False)  # (StreamCPUTask, T) on the CUDA path
    prefill_threshold: int | None = None  # layerwise GPU prefill from this many tokens on (None: never)
    dynamic_update: bool = False  # GPU/CPU expert swaps after each layerwise prefill
    layerwise_active: bool = False  # set by layerwise_forward for the duration of one forward
    layers: dict[int, HybridExperts] = field(default_factory=dict, repr=False)  # layer -> its hybrid experts
    layerwise: LayerwisePrefill | None = field(default=None, repr=False)
    _pinned: dict = field(default_factory=dict, repr=False)  # (parity, slot, cap) -> PinnedIO

    def __post_init__(self) -> None:
        if self.dynamic_update and self.prefill_threshold is None:
            raise ConfigError("--kt-enable-dynamic-expert-update needs --kt-gpu-prefill-token-threshold "
                              "(the update follows a layerwise prefill)")
        if self.prefill_threshold is not None and self.layerwise is None:
            self.layerwise = LayerwisePrefill(self)

    def collect_pending(self) -> None:
        """Waits for deferred CPU work left by an interrupted forward and drops its output."""
        if self.pending is not None:
            self.pending.experts.sync(self.pending.task)
            self.pending = None
        if self.pending_stream is not None:
            task, t = self.pending_stream
            task.enqueue_result(t, self.device)  # stream-ordered wait; the output is not used
            self.pending_stream = None

    def check_cpu_errors(self) -> None:
        """Raise (CPUMoEError) the first error of the CPU expert tasks finished since the last check.
        Tasks run from the CUDA stream (host functions, graph replays) cannot raise where they run:
        the engine calls this after each step's sampled ids are read, so a failed step fails its
        requests instead of returning tokens computed from stale CPU outputs."""
        for layer in self.layers.values():
            if layer.cpu is not None:  # one pool serves every layer; does not wait for running tasks
                layer.cpu.layer.pool.sync(max_pending=1 << 62)
                return

    def set_num_deferred(self, num_deferred: int) -> None:
        """Change every layer's deferral (benchmarks compare settings on one loaded model); decode
        CUDA graphs captured before must be captured again."""
        self.collect_pending()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.num_deferred = num_deferred
        for idx, layer in self.layers.items():
            layer.defer = 0 if idx == self.moe_layers[-1] else num_deferred
            layer._stream_tasks.clear()  # their (now, deferred) pairs were built for the old setting

    @contextmanager
    def layerwise_forward(self, num_tokens: int) -> Iterator[bool]:
        """Around one model forward of `num_tokens` tokens: layerwise (yields True) when the threshold
        is set and reached; never used around CUDA graph capture or replay."""
        if self.layerwise is None or self.prefill_threshold is None or num_tokens < self.prefill_threshold:
            yield False
            return
        self.collect_pending()
        self.layerwise.begin()
        self.layerwise_active = True
        try:
            yield True
        finally:
            self.layerwise_active = False
            self.layerwise.end()

    def pinned_io(self, layer_idx: int, slot: int, cap: int, k: int, hidden: int, dtype: torch.dtype):
        """Pinned buffers for a layer's CPU task (slot 0: now, 1: deferred), shared by every other
        MoE layer: layer L's deferred task still reads its buffers while layer L+1 runs, and is
        collected before layer L+2 writes them (stream order)."""
        from hybridmoe.moe.cuda_bridge import PinnedIO

        key = (self.moe_layers.index(layer_idx) % 2, slot, cap)
        io = self._pinned.get(key)
        if io is None:
            io = self._pinned[key] = PinnedIO(cap, k, hidden, dtype)
        return io

    @classmethod
    def from_args(cls, args: EngineArgs, hf_config, device: torch.device) -> HybridPlan | None:
        """None when no split is asked for (all experts on the GPU, or all on the CPU without deferral)."""
        from hybridmoe.models.registry import arch_spec

        threshold, dynamic = args.kt_gpu_prefill_token_threshold, args.kt_enable_dynamic_expert_update
        if args.kt_num_gpu_experts is None and args.kt_gpu_experts_ratio is None:
            for flag, value in (("--kt-max-deferred-experts-per-token", args.kt_max_deferred_experts_per_token),
                                ("--kt-gpu-prefill-token-threshold", threshold),
                                ("--kt-enable-dynamic-expert-update", dynamic)):
                if value:
                    raise ConfigError(f"{flag} needs a GPU/CPU expert split: set --kt-num-gpu-experts (or "
                                      "--kt-gpu-experts-ratio)")
            return None
        if dynamic and threshold is None:
            raise ConfigError("--kt-enable-dynamic-expert-update needs --kt-gpu-prefill-token-threshold "
                              "(the update follows a layerwise prefill)")
        spec = arch_spec(hf_config)
        n_gpu = gpu_experts_per_layer(spec.num_experts, args.kt_num_gpu_experts, args.kt_gpu_experts_ratio)
        # every expert on the CPU: the plain "cpu" backend, except on CUDA, where the hybrid layer
        # (empty GPU side) drives the CPU through stream host functions and CUDA graphs stay on
        if n_gpu == 0 and not args.kt_max_deferred_experts_per_token and threshold is None and device.type != "cuda":
            return None  # every expert on the CPU: the plain "cpu" backend
        try:
            masks = place_experts(args.kt_expert_placement_strategy, list(spec.moe_layers), spec.num_experts,
                                  n_gpu, args.init_expert_location, args.random_seed)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        gpu_backend = args.moe_backend if args.moe_backend in ("torch", "triton") else (
            "triton" if device.type == "cuda" else "torch")
        on_gpu = sum(int(m.sum()) for m in masks.values())
        log.info("hybrid experts: %d of %d routed experts on the %s (%s placement), the rest on the CPU; "
                 "%d deferred per token", on_gpu, spec.num_experts * len(masks), device.type,
                 args.kt_expert_placement_strategy, args.kt_max_deferred_experts_per_token)
        if threshold is not None:
            log.info("layerwise prefill: forwards of %d tokens or more compute every expert on the %s%s", threshold,
                     device.type, "; dynamic expert update on (the CPU holds every expert)" if dynamic else "")
        return cls(masks, list(spec.moe_layers), args.kt_max_deferred_experts_per_token, gpu_backend, device,
                   prefill_threshold=threshold, dynamic_update=dynamic)


def _rows(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """t[ids] along dim 0; a view (no copy of gigabytes) when ids is a contiguous range, as with the
    uniform and front-loading placements."""
    n = len(ids)
    if n and int(ids[-1]) - int(ids[0]) == n - 1:
        return t[int(ids[0]) : int(ids[0]) + n]
    return t[ids]


def _local_index(mask: torch.Tensor) -> torch.Tensor:
    """[E] int32: position of each expert among the selected ones, -1 for the others."""
    idx = torch.full(mask.shape, -1, dtype=torch.int32)
    idx[mask] = torch.arange(int(mask.sum()), dtype=torch.int32)
    return idx


class HybridExperts(MoEExperts):
    name = "hybrid"

    def __init__(self, weights: ExpertWeights, layer_idx: int, options: dict) -> None:
        from hybridmoe.moe.cpu_experts import CPUExperts

        plan: HybridPlan = options["hybrid"]
        self.plan, self.layer_idx = plan, layer_idx
        self.options = options
        mask = plan.masks[layer_idx]
        dev = plan.device
        self.hidden = weights.hidden_size
        self.num_experts = weights.num_experts
        self.activation = weights.activation
        self.dtype = weights.gate_up.dtype
        self.moe_index = plan.moe_layers.index(layer_idx)
        # with dynamic update the CPU layer holds every expert: cpu_local is an expert's row there
        self.full_cpu_layer = plan.dynamic_update
        self.gpu_local = _local_index(mask).to(dev)  # [E]
        self.cpu_local = (torch.where(mask, -1, torch.arange(len(mask), dtype=torch.int32)) if self.full_cpu_layer
                          else _local_index(~mask)).to(dev)  # [E]
        # slot in the layerwise buffer (CPU-resident experts in expert order); = cpu_local without dynamic update
        self.stream_local = _local_index(~mask).to(dev) if self.full_cpu_layer else self.cpu_local  # [E]
        self.mask_dev = mask.to(dev)  # [E] True = GPU-resident (kept current by dynamic update)
        self.is_first = layer_idx == plan.moe_layers[0]
        self.defer = 0 if layer_idx == plan.moe_layers[-1] else plan.num_deferred
        gpu_ids, cpu_ids = mask.nonzero().flatten(), (~mask).nonzero().flatten()
        self.num_gpu, self.num_streamed = len(gpu_ids), len(cpu_ids)
        self.gpu: MoEExperts | None = None
        self.gpu_w: ExpertWeights | None = None  # the GPU-resident experts' weights [Eg, ...]
        self._stream_tasks: dict[int, tuple] = {}  # token capacity -> (now, deferred) StreamCPUTasks
        self._streamed: MoEExperts | None = None  # the GPU backend over the layerwise buffer
        self.cpu: CPUExperts | None = None
        if len(gpu_ids):  # only these experts' weights go to the GPU
            self.gpu_w = ExpertWeights(_rows(weights.gate_up, gpu_ids).to(dev).contiguous(),
                                       _rows(weights.down, gpu_ids).to(dev).contiguous(), weights.activation)
            self.gpu = create_experts(plan.gpu_backend, self.gpu_w, layer_idx, options)
        if len(cpu_ids):  # only these stay in host memory, packed for the CPU kernels (all with dynamic update)
            host = weights if self.full_cpu_layer else ExpertWeights(_rows(weights.gate_up, cpu_ids), _rows(weights.down, cpu_ids),
                                                                     weights.activation)
            page_align = plan.layerwise is not None and dev.type == "cuda"  # page-locked in place below
            self.cpu = CPUExperts(host, layer_idx, {**options, "page_align": page_align})
            if plan.layerwise is not None:
                packed = self.cpu.layer.packed
                if self.full_cpu_layer and packed.num_experts != self.num_experts:
                    raise ConfigError(f"--kt-enable-dynamic-expert-update: the CPU layer {layer_idx} holds "
                                      f"{packed.num_experts} experts, expected all {self.num_experts}")
                self.fmt = PackedFormat.of(packed)
                self.packed_parts = packed_parts(packed)  # [E_cpu, ...] host tensors the prefill streams
                self.runs = stream_runs(mask, self.full_cpu_layer)
                self.pinned = dev.type != "cuda" or page_lock(packed, list(self.packed_parts.values()), dev)
        plan.layers[layer_idx] = self

    def _split(self, ids: torch.Tensor, topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """CPU-local ids [T, K] of the pairs computed now, and of those deferred (None: no deferral);
        -1 marks a pair the task skips. Device ops only (no sync)."""
        cid = self.cpu_local[ids]  # -1 where the expert is on the GPU
        if not self.defer:
            return cid, None
        on_cpu = cid >= 0
        # each token's `defer` lowest-weight CPU experts
        order = torch.where(on_cpu, topk_weights.float(), float("inf")).argsort(dim=1, stable=True)
        later = torch.zeros_like(on_cpu).scatter_(1, order[:, : self.defer], True) & on_cpu
        return torch.where(later, -1, cid), torch.where(later, cid, -1)

    def _gpu_part(self, x: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.gpu is None:
            return torch.zeros(x.shape[0], self.hidden, dtype=torch.float32, device=x.device)
        gid = self.gpu_local[ids]
        valid = gid >= 0
        # pairs of CPU experts: expert 0 with weight 0 (cheaper than a ragged batch on the GPU)
        return self.gpu.forward(x, torch.where(valid, gid, 0), torch.where(valid, topk_weights, 0.0)).float()

    def _forward_stream(self, x: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """CUDA: the CPU side as stream host functions (capturable)."""
        from hybridmoe.moe.cuda_bridge import StreamCPUTask

        plan, t = self.plan, x.shape[0]
        if self.is_first and plan.pending_stream is not None:  # left by an interrupted forward: not ours
            plan.collect_pending()
        tasks = None
        if self.cpu is not None:
            cap = 1 << max(0, (t - 1).bit_length())
            tasks = self._stream_tasks.get(cap)
            if tasks is None:
                def io(slot: int):
                    return plan.pinned_io(self.layer_idx, slot, cap, ids.shape[1], self.hidden, x.dtype)

                first = StreamCPUTask(self.cpu.layer, io(0))
                # the deferred task reads the immediate one's x and w: one copy of each
                tasks = self._stream_tasks[cap] = (
                    first, StreamCPUTask(self.cpu.layer, io(1), shared_input=io(0)) if self.defer else None)
            now, later = self._split(ids, topk_weights)
            w = topk_weights.float()
            if later is None:
                tasks[0].enqueue_submit(x, now.int(), w)
            else:  # both tasks queued by one host function
                tasks[0].enqueue_submit_with(tasks[1], x, now.int(), later.int(), w)
        out = self._gpu_part(x, ids, topk_weights)  # runs while the CPU works
        pending = plan.pending_stream
        if tasks is not None and pending is not None and pending[1] == t:
            # the previous layer's deferred task ran before this layer's (in-order pool): one wait
            mine, earlier = tasks[0].enqueue_result_with(pending[0], t, x.device)
            out += mine
            out += earlier
        else:
            if tasks is not None:
                out += tasks[0].enqueue_result(t, x.device)
            if pending is not None:
                task, pt = pending
                out += task.enqueue_result(pt, x.device)
        plan.pending_stream = (tasks[1], t) if tasks is not None and self.defer else None
        return out.to(x.dtype)

    def _forward_layerwise(self, x: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Every expert on the GPU side: the resident ones, and the CPU-resident ones streamed in and
        dequantized (layerwise.py); the next MoE layer's copy is issued first. Defers nothing."""
        lw = self.plan.layerwise
        assert lw is not None
        lw.prefetch(self.moe_index)
        lw.prefetch(self.moe_index + 1)  # overlaps this layer's compute
        out = self._gpu_part(x, ids, topk_weights)  # [T, H] f32, while the copy finishes
        if self.cpu is not None:
            w = lw.acquire(self)  # [Ec, 2I, H], [Ec, H, I] views of the shared buffer
            if self._streamed is None:
                self._streamed = create_experts(self.plan.gpu_backend, w, self.layer_idx, self.options)
            sid = self.stream_local[ids]
            valid = sid >= 0
            # pairs of GPU-resident experts: streamed expert 0 with weight 0 (as in _gpu_part)
            out += self._streamed.forward(x, torch.where(valid, sid, 0), torch.where(valid, topk_weights, 0.0)).float()
            if self.plan.dynamic_update and self.gpu_w is not None:
                counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts)  # [E] tokens per expert
                cap = min(self.num_gpu, self.num_streamed)
                rec = swap_hot_experts(counts, self.mask_dev, self.gpu_local, self.cpu_local, self.stream_local,
                                       self.gpu_w, w, cap)
                lw.note_swaps(self, rec)
        return out.to(x.dtype)

    def apply_host_swaps(self, moved: list[tuple[int, int, int, int]]) -> None:
        """After a dynamic update (device side already done): host mask and copy plan."""
        mask = self.plan.masks[self.layer_idx]
        for e_in, e_out, _, _ in moved:
            mask[e_in], mask[e_out] = True, False
        self.runs = stream_runs(mask, self.full_cpu_layer)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.plan.layerwise_active:
            return self._forward_layerwise(x, topk_ids.long(), topk_weights)
        if _use_stream(x):
            return self._forward_stream(x, topk_ids.long(), topk_weights)
        plan = self.plan
        if self.is_first and plan.pending is not None:  # left over by an interrupted forward
            plan.pending.experts.sync(plan.pending.task)
            plan.pending = None
        ids = topk_ids.long()
        task = None
        deferred = None
        if self.cpu is not None:
            now, later = self._split(ids, topk_weights)
            x_h = x.detach().to("cpu").contiguous()
            w_h = topk_weights.float().to("cpu").contiguous()
            out_h = torch.empty(x.shape[0], self.hidden, dtype=torch.float32)
            task = self.cpu.submit(x_h, now.to("cpu", torch.int32).contiguous(), w_h, out_h)
            if later is not None:
                later_out = torch.empty_like(out_h)
                task_later = self.cpu.submit(x_h, later.to("cpu", torch.int32).contiguous(), w_h, later_out)
                deferred = _Deferred(self.cpu, task_later, later_out)
        out = self._gpu_part(x, ids, topk_weights)
        if task is not None:
            self.cpu.sync(task)
            out += out_h.to(x.device)
        if plan.pending is not None:
            plan.pending.experts.sync(plan.pending.task)
            out += plan.pending.out.to(x.device)
        plan.pending = deferred
        return out.to(x.dtype)


def _use_stream(x: torch.Tensor) -> bool:
    """The CUDA stream path (a test on the CPU emulates the stream by running host functions inline)."""
    return USE_STREAM_HOST_FUNCTIONS and x.is_cuda


@register_experts_backend("hybrid")
def _make_hybrid(weights: ExpertWeights, layer_idx: int, options: dict) -> MoEExperts:
    return HybridExperts(weights, layer_idx, options)
