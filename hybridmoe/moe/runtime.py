"""The per-forward state that the hybrid MoE layers of one model share, and the runner's view of it.

Legend: T tokens, K top-k, H hidden.

`HybridRuntime` is created by the model runner from the frozen `HybridPlacement` and handed to
every hybrid MoE layer at construction (ExpertsOptions.runtime); the runner attaches the built
layers once the model is loaded. It holds:
- the deferral chain: the CPU work a MoE layer deferred, collected by the next MoE layer;
- the pinned host buffers the CUDA stream path copies through (shared by alternating layers);
- the layerwise-prefill driver (moe/layerwise.py) and whether a layerwise forward is running;
- the gated-submit recorder used while a decode CUDA graph is captured;
- the CPU error check after a step.
The runner talks to it only through the `MoEHooks` interface (engine/hooks.py): capture,
before-replay, forward scope, blocking sync wanted, check errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybridmoe import envs
from hybridmoe.config import ConfigError
from hybridmoe.engine.hooks import CaptureRecord, MoEHooks
from hybridmoe.moe.cuda_bridge import GatedSubmitter, PinnedIO, SubmitProgram
from hybridmoe.moe.layerwise import LayerwisePrefill
from hybridmoe.moe.placement import HybridPlacement

if TYPE_CHECKING:
    from hybridmoe.cpu.engine import CPUThreadPool
    from hybridmoe.moe.cpu_experts import CPUExperts
    from hybridmoe.moe.cuda_bridge import StreamCPUTask
    from hybridmoe.moe.hybrid import HybridExperts


@dataclass
class HostDeferred:
    """Deferred CPU work driven from Python (the CPU device): a task writing a host buffer."""

    experts: CPUExperts
    task: int
    out: torch.Tensor  # [T, H] float32 host

    def collect(self, device: torch.device) -> torch.Tensor:  # [T, H] float32
        self.experts.sync(self.task)
        return self.out.to(device)

    def drop(self, device: torch.device) -> None:
        self.experts.sync(self.task)


@dataclass
class StreamDeferred:
    """Deferred CPU work driven from the CUDA stream: its wait is a stream host function."""

    task: StreamCPUTask
    t: int  # tokens

    def collect(self, device: torch.device) -> torch.Tensor:  # [T, H] float32, stream-ordered
        return self.task.enqueue_result(self.t, device)

    def wait(self) -> torch.Tensor:  # [T, H] float32 in pinned memory, stream-ordered (StreamCPUTask.enqueue_wait)
        return self.task.enqueue_wait(self.t)

    def drop(self, device: torch.device) -> None:
        self.task.enqueue_result(self.t, device)  # stream-ordered wait; the output is not used


STREAM_WAITS = ("auto", "memop", "hostfn")


def check_stream_wait(mode: str, device: torch.device) -> str:
    """The wait to use for HybridConfig.stream_wait `mode` ("memop" or "hostfn"; "auto": memop where the
    driver has the stream memory operations), else ConfigError: "memop" needs them (CUDA 12+)."""
    if mode not in STREAM_WAITS:
        raise ConfigError(f"--hybrid-stream-wait: got {mode!r}, expected one of {', '.join(STREAM_WAITS)}")
    if mode != "hostfn" and device.type == "cuda":
        from hybridmoe.cuda_driver import stream_memops_supported

        if not stream_memops_supported():
            if mode == "memop":
                raise ConfigError("--hybrid-stream-wait memop: this CUDA driver has no stream memory operations "
                                  "(cuStreamWaitValue32; CUDA 12 or later): use hostfn")
            return "hostfn"
    return "memop" if mode == "auto" else mode


class HybridRuntime(MoEHooks):
    """Shared, mutable, per-forward state of a model's hybrid MoE layers (see the module docstring)."""

    def __init__(self, placement: HybridPlacement, device: torch.device, pool: CPUThreadPool | None,
                 blocking_sync: bool = True, stream_wait: str = "auto") -> None:
        self.placement = placement
        self.device = device
        self.moe_layers = placement.moe_layers
        self.pool = pool
        self.num_deferred = placement.num_deferred
        self.blocking_sync = blocking_sync and device.type == "cuda"
        self.stream_wait = check_stream_wait(stream_wait, device)  # how the stream waits for a CPU task
        # with memop waits, a one-token layer's task and its deferred one run as one native task (cuda_bridge):
        # deferral-2 decode at batch 1 +5 / +9 / +15% against two tasks (H100 host, session 30)
        self.merge_deferred = True
        # CUDA: a layer hands over to its CPU task (and back) by handoff_triton.py's two kernels, not ~12 copies
        # and small kernels; set_fused_handoff for A/B runs (a CPU test sets it under the Triton interpreter)
        self.fused_handoff = device.type == "cuda" and envs.handoff_fused()
        self.pending: HostDeferred | StreamDeferred | None = None  # the previous MoE layer's deferred work
        self.layerwise_active = False  # set by forward_scope for the duration of one layerwise forward
        self.layers: dict[int, HybridExperts] = {}  # attached by the runner after loading
        self._pinned: dict[tuple[int, int, int], PinnedIO] = {}  # (parity, slot, cap) -> buffers
        # the tokens' LoRA slots, the same for every layer of a forward: one pinned buffer per cap that every
        # layer's tasks read, copied by the forward's first layer with a CPU task (lora_staged: done)
        self._lora_pinned: dict[int, torch.Tensor] = {}
        self.lora_staged = False
        self.submitter = GatedSubmitter()  # the layers' stream tasks queue (or, during a capture, record) through it
        self.layerwise = LayerwisePrefill(self) if placement.prefill_threshold is not None else None
        self.num_layerwise_prefills = 0  # forwards run layerwise (metrics)
        # True for a forward that must keep the CPU/GPU split although it reaches the threshold: its
        # tokens use expert LoRA whose CPU share lives with the CPU engine (lora/setup.py sets it)
        self.layerwise_veto: Callable[[], bool] | None = None

    def attach(self, layers: Mapping[int, HybridExperts]) -> None:
        """The model's hybrid MoE layers by layer index (layerwise prefill and deferral changes need them)."""
        self.layers = dict(layers)

    # ---- deferral chain ----
    def collect_pending(self) -> None:
        """Waits for deferred CPU work left by an interrupted forward and drops its output."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.drop(self.device)

    def _settle(self) -> None:
        """Before a setting of the stream tasks changes: deferred work collected, the device idle, and every
        layer's stream tasks dropped (rebuilt with the new setting at their next forward)."""
        self.collect_pending()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for layer in self.layers.values():
            layer.drop_stream_tasks()

    def set_num_deferred(self, num_deferred: int) -> None:
        """Change every layer's deferral on a loaded model (benchmarks compare settings without
        reloading); decode CUDA graphs captured before must be captured again."""
        self._settle()
        self.num_deferred = num_deferred
        for idx, layer in self.layers.items():
            layer.set_defer(self.placement.defer_of(idx, num_deferred))

    def set_stream_wait(self, mode: str) -> None:
        """Switch how the stream waits for CPU tasks on a loaded model ("memop", "hostfn" or "auto"; benchmarks
        compare them in one process); decode CUDA graphs captured before must be captured again."""
        mode = check_stream_wait(mode, self.device)
        self._settle()
        self.stream_wait = mode

    def set_merge_deferred(self, on: bool) -> None:
        """Whether a one-token layer's task and its deferred task run as one native task (with memop waits;
        benchmarks compare both in one process); decode CUDA graphs captured before must be captured again."""
        self._settle()
        self.merge_deferred = bool(on)

    def set_fused_handoff(self, on: bool) -> None:
        """Whether layers hand over to their CPU tasks by handoff_triton.py's kernels (benchmarks compare both in
        one process); decode CUDA graphs captured before must be captured again."""
        self._settle()
        self.fused_handoff = bool(on)

    # ---- buffers of the CUDA stream path ----
    def pinned_io(self, layer_idx: int, slot: int, cap: int, k: int, hidden: int, dtype: torch.dtype) -> PinnedIO:
        """Pinned buffers for a layer's CPU task (slot 0: now, 1: deferred), shared by every other
        MoE layer: layer L's deferred task still reads its buffers while layer L+1 runs, and is
        collected before layer L+2 writes them (stream order)."""
        key = (self.moe_layers.index(layer_idx) % 2, slot, cap)
        io = self._pinned.get(key)
        if io is None:
            lora = self._lora_pinned.get(cap)
            if lora is None:
                lora = self._lora_pinned[cap] = torch.full((cap,), -1, dtype=torch.int32,
                                                           pin_memory=torch.cuda.is_available())
            io = self._pinned[key] = PinnedIO(cap, k, hidden, dtype, lora=lora)
        return io

    # ---- MoEHooks: what the model runner calls ----
    @contextmanager
    def capture(self) -> Iterator[CaptureRecord]:
        """Around one CUDA graph capture: the gated submits of the captured forward are recorded;
        `record.before_replay` queues them, in order, with one native call."""
        record = CaptureRecord()
        with self.submitter.recording() as submits:
            yield record
        if submits:
            record.before_replay = SubmitProgram(submits).submit

    @contextmanager
    def forward_scope(self, num_tokens: int) -> Iterator[bool]:
        """Around one eager forward of `num_tokens` tokens: layerwise (yields True) when the threshold
        is set and reached; never used around CUDA graph capture or replay."""
        threshold = self.placement.prefill_threshold
        if self.layerwise is None or threshold is None or num_tokens < threshold or (
                self.layerwise_veto is not None and self.layerwise_veto()):
            yield False
            return
        self.collect_pending()
        self.num_layerwise_prefills += 1
        self.layerwise.begin()
        self.layerwise_active = True
        try:
            yield True
        finally:
            self.layerwise_active = False
            self.layerwise.end()

    def discard_failed_step(self) -> None:
        """The failed forward's deferred task and the pool's other tasks waited for, their errors dropped:
        a deferred task of the failed step reported its error in the next forward, naming a token of the
        failed batch (the retried step then failed a request that was not at fault). CPU device only: on
        CUDA the tasks may wait on a stream that will not reach them."""
        if self.device.type != "cpu":
            return
        from hybridmoe.cpu.engine import CPUMoEError

        try:
            self.collect_pending()
        except CPUMoEError:
            pass
        self._drain_pool()

    def _drain_pool(self) -> None:
        """Wait for every queued CPU task; their errors (a failed step's) are dropped."""
        from hybridmoe.cpu.engine import CPUMoEError

        if self.pool is not None:
            for _ in range(64):  # each sync reports the errors of the tasks finished by then
                try:
                    self.pool.sync()
                    break
                except CPUMoEError:
                    continue

    def check_errors(self) -> None:
        """Raise (CPUMoEError) the first error of the CPU expert tasks finished since the last check.
        Tasks run from the CUDA stream (host functions, graph replays) cannot raise where they run:
        the engine calls this after each step's sampled ids are read, so a failed step fails its
        requests instead of returning tokens computed from stale CPU outputs. Before it raises, the
        stream tasks are settled (`_settle_stream_tasks`)."""
        from hybridmoe.cpu.engine import CPUMoEError

        if self.pool is None:
            return
        try:
            self.pool.sync(max_pending=1 << 62)  # does not wait for running tasks
        except CPUMoEError:
            self._settle_stream_tasks()
            raise

    def _settle_stream_tasks(self) -> None:
        """After a failed step: the device's queued work finished, then the pool's tasks (their errors, the
        failed steps', dropped), then every stream task's go word cleared. A task skipped at the gate timeout
        (CPUEngineSettings.gate_timeout_s: the GPU stalled) leaves its go word to a GPU that sets it later; a 1
        left there would start that task's next run at once, before the GPU has written its inputs."""
        tasks = [task for layer in self.layers.values() for task in layer.stream_tasks()]
        if not tasks:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # every go word the queued work sets is set (done words never hang)
        self._drain_pool()
        with torch.inference_mode():  # (the words were made under it)
            for task in tasks:
                task.go.zero_()
