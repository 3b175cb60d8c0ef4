"""CPU expert tasks driven from a CUDA stream, so the CPU side of a hybrid MoE layer is
stream-ordered work: no Python runs between the GPU kernels, and a decode step with CPU experts
can be captured in a CUDA graph.

Legend: T tokens, K top-k, H hidden.

Fixed pinned buffers x_h [T, H], ids_h [T, K], w_h [T, K], out_h [T, H] (shared by the layers) and
one HostCall struct per (layer, T). On the stream: D2H copies into the buffers -> a copy that sets
the task's pinned "go" word -> the GPU's own work -> host function `hm_sync_hostfn` (blocks the
stream until the task is done) -> H2D copy of out_h. The task itself is queued from Python at
once (a gated submit) and starts when the pool's leader thread, idle anyway, sees its go word
set, so the stream needs no host function to start it. With deferral a layer's deferred task is
queued right behind its immediate one (ungated), and one host function (`hm_sync2_hostfn`) waits
for a layer's task and the previous layer's deferred one (every host function is a trip through
the driver's callback thread, and the stream waits for it). A captured decode graph replays no
Python, so the layers' `GatedSubmitter` records the gated submits of the capture and the graph's
owner queues them (`SubmitProgram.submit`) before each replay.

The host functions are C entry points of the native library (no Python runs inside them),
enqueued with hybridmoe.cuda_driver.launch_host_func.

Waits by memory operations (`memops`, HybridConfig.stream_wait "memop"): each task gets a pinned
"done" word that the pool sets when the task ends (failed or skipped too); the stream waits for it
with cuStreamWaitValue32 (the GPU polls the word) and clears it with cuStreamWriteValue32. No host
function and no driver callback thread is then between a CPU result and the GPU's next kernel. A
task's next run starts only after its next go word, which the stream sets after that clear.
"""

from __future__ import annotations

import ctypes as C
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hybridmoe.cpu import native
from hybridmoe.cuda_driver import host_device_pointer, launch_host_func, stream_wait_value32, stream_write_value32


class GatedSubmitter:
    """Queues stream tasks' gated submits, or records them while a decode graph is captured (the
    GPU runs nothing then). One per HybridRuntime: no module-level state."""

    def __init__(self) -> None:
        self._recording: list[tuple[native.HostCall, int | None, object]] | None = None

    @contextmanager
    def recording(self) -> Iterator[list]:
        """Around a CUDA graph capture: the gated submits the captured forward makes are collected,
        in order, instead of queued; wrap the list in a SubmitProgram and submit it before every
        replay of that graph."""
        if self._recording is not None:
            raise RuntimeError("GatedSubmitter.recording is already active")
        self._recording = []
        try:
            yield self._recording
        finally:
            self._recording = None

    def submit(self, call: native.HostCall, go: torch.Tensor | None) -> None:
        """Queue `call`'s task now, started once `go` is set (None: not gated); recorded instead
        while a graph is captured."""
        go_ptr = None if go is None else go.data_ptr()
        if self._recording is not None:
            self._recording.append((call, go_ptr, go))
            return
        if go is not None and go.is_pinned() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a hybrid MoE layer was captured in a CUDA graph outside GatedSubmitter.recording: "
                               "its CPU tasks would never be queued at replay")
        native.lib().hm_submit_gated(C.byref(call), go_ptr)


class SubmitProgram:
    """The gated submits of one captured graph, queued in capture order by one native call."""

    def __init__(self, recorded: list) -> None:
        n = len(recorded)
        self.n = n
        self._keep = recorded  # the HostCalls and go words must live as long as the program
        self._calls = (C.POINTER(native.HostCall) * n)(*(C.pointer(c) for c, _, _ in recorded))
        self._gos = (C.c_void_p * n)(*(go for _, go, _ in recorded))

    def submit(self) -> None:
        native.lib().hm_submit_gated_many(self._calls, self._gos, self.n)


class PinnedIO:
    """Pinned host buffers for up to `cap` tokens: x [cap, H], ids [cap, K], w [cap, K], out [cap, H],
    lora [cap] (the tokens' LoRA slots, -1: none; read by a task only with LoRA attached; `lora` passed
    in: a buffer every layer shares, copied once a forward).

    Their addresses never change, so a captured graph keeps using them. Layers share them (the
    stream runs one layer after the other): see HybridRuntime.pinned_io."""

    def __init__(self, cap: int, k: int, hidden: int, x_dtype: torch.dtype, lora: torch.Tensor | None = None) -> None:
        self.cap = cap
        pin = torch.cuda.is_available()  # (False only in the CPU test that emulates the stream)
        self.x = torch.empty(cap, hidden, dtype=x_dtype, pin_memory=pin)  # [cap, H]
        self.ids = torch.full((cap, k), -1, dtype=torch.int32, pin_memory=pin)  # [cap, K]
        self.w = torch.zeros(cap, k, dtype=torch.float32, pin_memory=pin)  # [cap, K]
        self.out = torch.zeros(cap, hidden, dtype=torch.float32, pin_memory=pin)  # [cap, H]
        self.lora = torch.full((cap,), -1, dtype=torch.int32, pin_memory=pin) if lora is None else lora  # [cap]


class StreamCPUTask:
    """One layer's CPU expert task driven from a CUDA stream, on a PinnedIO's buffers; one HostCall
    per token count T points at their first T rows. `shared_input`: read x and w from that PinnedIO
    instead (a deferred task reads the immediate task's copies; only its ids are its own). `memops`:
    the stream waits on the task's done word instead of a host function (module docstring). `merge`
    (with memops): a one-token task and its deferred one run as one native task (HmTask.ids2), the
    deferred pairs after the immediate ones, the immediate output marked done first (HmTask.done1)."""

    def __init__(self, cpu_layer, io: PinnedIO, shared_input: PinnedIO | None = None,
                 submitter: GatedSubmitter | None = None, memops: bool = False, merge: bool = False) -> None:
        self.submitter = submitter or GatedSubmitter()
        self.layer = cpu_layer
        self.io = io
        src = shared_input or io
        self.x, self.ids, self.w, self.out = src.x, io.ids, src.w, io.out
        self.lora = src.lora  # per token, like x
        self.calls: dict[int, native.HostCall] = {}
        # per T (_key): submits queued without their wait queued yet (a forward interrupted in between
        # leaves 1: the next submit first queues the missed wait, so waits and submits stay paired)
        self.unsynced: dict[int, int] = {}
        pin = torch.cuda.is_available()
        self.go = torch.zeros(1, dtype=torch.int32, pin_memory=pin)  # set by the stream: the task may start
        # memops: set to 1 by the pool when a task of this one ends, cleared by the stream after its wait
        self.done = torch.zeros(1, dtype=torch.int32, pin_memory=pin) if memops else None
        self._done_addr = None if self.done is None else host_device_pointer(self.done) if pin else self.done.data_ptr()
        self._one: torch.Tensor | None = None  # int32 [1] = 1 on the stream's device (the go copy's source)
        self._ticket: torch.Tensor | None = None  # the hand-over kernel's counter (handoff_triton.new_ticket)
        self.pairs: dict[tuple[int, int], native.HostCallPair] = {}  # (T, id(other)) -> pair
        self.merge = merge and memops
        self.merged: dict[tuple[int, int], native.HostCall] = {}  # (T, id(deferred task)) -> the merged call
        self.sync_fn, self.sync2_fn = native.wait_host_functions()

    def _call(self, t: int) -> native.HostCall:
        call = self.calls.get(t)
        if call is None:
            # nan_rows: a token whose own values are non-finite gets NaN out, and its request fails alone at
            # sampling (engine/sampler.py NAN_ROW); an error here would surface after the step and fail the
            # whole batch, and the next one
            task, _ = self.layer.make_task(self.x[:t], self.ids[:t], self.w[:t], self.out[:t], lora_idx=self.lora[:t],
                                           nan_rows=True)
            call = self.calls[t] = native.HostCall(self.layer.pool.handle, task, 0, 0, 0, 0,
                                                   done=None if self.done is None else self.done.data_ptr())
        # (a failed task is reported with its message by the engine's CPU error check after the
        # step; the status flag only records it here)
        return call

    def _release(self, device: torch.device) -> None:
        """Stream-ordered, after the input copies: the go word that starts a gated task."""
        if self._one is None or self._one.device != device:
            self._one = torch.ones(1, dtype=torch.int32, device=device)
        self.go.copy_(self._one, non_blocking=True)

    def _merged_call(self, t: int, later: StreamCPUTask) -> native.HostCall:
        """One native task for this task's pairs and `later`'s (its deferred ones): this task's done word set
        once its output is written (done1), `later`'s when all is done (the HostCall's)."""
        key = (t, id(later))
        call = self.merged.get(key)
        if call is None:
            task, _ = self.layer.make_task(self.x[:t], self.ids[:t], self.w[:t], self.out[:t], lora_idx=self.lora[:t],
                                           nan_rows=True, ids2=later.ids[:t], out2=later.out[:t], done1=self.done)
            call = self.merged[key] = native.HostCall(self.layer.pool.handle, task, 0, 0, 0, 0,
                                                      done=later.done.data_ptr())
        return call

    def _wait(self, t: int) -> None:
        """Stream-ordered: block the stream until the last task submitted for T = t is done."""
        if self._done_addr is None:
            launch_host_func(self.sync_fn, self._call(t))
        else:
            stream_wait_value32(self._done_addr, 1)
            stream_write_value32(self._done_addr, 0)

    def _key(self, t: int) -> int:
        """`unsynced`'s key: per T with host functions (a HostCall's own id ring); one for all T with
        memops (one done word: a stale 1 left by any T's task would release the next wait early)."""
        return t if self._done_addr is None else 0

    def _begin_submit(self, t: int) -> None:
        if self.unsynced.get(self._key(t), 0):  # an interrupted forward's task: waited for before reuse
            self._wait(t)
        self.unsynced[self._key(t)] = 1

    def enqueue_submit(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                       lora: torch.Tensor | None = None) -> None:
        """Copy the inputs out (stream-ordered) and start the CPU task once they have landed. lora:
        int32 [T] the tokens' LoRA slots (None: leave the buffer as it is: all -1 unless LoRA wrote it,
        or written by an earlier layer of this forward into the buffer the layers share)."""
        t = x.shape[0]
        self._begin_submit(t)
        self.x[:t].copy_(x, non_blocking=True)
        if lora is not None:
            self.lora[:t].copy_(lora, non_blocking=True)
        self.ids[:t].copy_(ids, non_blocking=True)
        self.w[:t].copy_(w, non_blocking=True)
        self._release(x.device)
        self.submitter.submit(self._call(t), self.go)

    def enqueue_wait(self, t: int) -> torch.Tensor:
        """Block the stream until the task is done; its output, in pinned memory: [T, H] float32 (read it
        stream-ordered, before this task's next submit)."""
        self._wait(t)
        self.unsynced[self._key(t)] = 0
        return self.out[:t]

    def enqueue_result(self, t: int, device: torch.device) -> torch.Tensor:
        """Block the stream until the task is done, then bring its output back: [T, H] float32."""
        return self.enqueue_wait(t).to(device, non_blocking=True)

    def _pair(self, t: int, other: StreamCPUTask) -> native.HostCallPair:
        key = (t, id(other))
        pair = self.pairs.get(key)
        if pair is None:  # both HostCalls live in their tasks' caches, as long as this pair
            pair = self.pairs[key] = native.HostCallPair(C.pointer(self._call(t)), C.pointer(other._call(t)))
        return pair

    def enqueue_submit_with(self, later: StreamCPUTask, x: torch.Tensor, ids: torch.Tensor,
                            later_ids: torch.Tensor, w: torch.Tensor, lora: torch.Tensor | None = None) -> None:
        """This task and a deferred one that shares its x and w (built with shared_input=this
        task's PinnedIO): x and w copied once; the deferred task is queued right behind the gated
        one, so it needs no gate."""
        assert later.x.data_ptr() == self.x.data_ptr() and later.w.data_ptr() == self.w.data_ptr()
        t = x.shape[0]
        self._begin_submit(t)
        later._begin_submit(t)
        self.x[:t].copy_(x, non_blocking=True)
        if lora is not None:  # the deferred task reads it too (shared input)
            self.lora[:t].copy_(lora, non_blocking=True)
        self.ids[:t].copy_(ids, non_blocking=True)
        later.ids[:t].copy_(later_ids, non_blocking=True)
        self.w[:t].copy_(w, non_blocking=True)
        self._release(x.device)
        self._submit(t, later)

    def _submit(self, t: int, later: StreamCPUTask | None) -> None:
        """Queue this task (gated on its go word) and `later`'s (deferred, ungated, right behind it), or both as
        one native task (merge, one token)."""
        if later is not None and self.merge and later.merge and t == 1:  # one task; each output's done word as with two
            self.submitter.submit(self._merged_call(t, later), self.go)
            return
        self.submitter.submit(self._call(t), self.go)
        if later is not None:
            self.submitter.submit(later._call(t), None)

    def enqueue_handoff(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, cpu_local: torch.Tensor,
                        gpu_local: torch.Tensor | None, later: StreamCPUTask | None = None, defer: int = 0,
                        lora: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """enqueue_submit / enqueue_submit_with in one kernel (handoff_triton.py): from the router's ids [T, K]
        and weights, the pinned x, now-ids (and `later`'s deferred ids: each token's `defer` lowest-weight CPU
        pairs), weights and the go word. Returns the GPU experts' (ids, weights) [T, K], None without GPU experts."""
        from hybridmoe.moe.handoff_triton import handoff, new_ticket

        t = x.shape[0]
        assert (later is None) == (defer == 0)
        if later is not None:
            assert later.x.data_ptr() == self.x.data_ptr() and later.w.data_ptr() == self.w.data_ptr()
        self._begin_submit(t)
        if later is not None:
            later._begin_submit(t)
        if lora is not None:  # stream-ordered before the kernel that sets the go word
            self.lora[:t].copy_(lora, non_blocking=True)
        if self._ticket is None or self._ticket.device != x.device:
            self._ticket = new_ticket(x.device)
        gpu = handoff(x, ids, w, cpu_local, gpu_local, defer, self.x, self.ids, None if later is None else later.ids,
                      self.w, self.go, self._ticket)
        self._submit(t, later)
        return gpu

    def enqueue_wait_with(self, earlier: StreamCPUTask, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block the stream until this task and `earlier` (submitted before it: the previous
        layer's deferred task) are done, with one host function (or two memory-operation waits);
        both outputs [T, H] float32, in pinned memory (as enqueue_wait)."""
        if self._done_addr is None and earlier._done_addr is None:
            launch_host_func(self.sync2_fn, self._pair(t, earlier))
        else:
            earlier._wait(t)
            self._wait(t)
        self.unsynced[self._key(t)] = earlier.unsynced[earlier._key(t)] = 0
        return self.out[:t], earlier.out[:t]

    def enqueue_result_with(self, earlier: StreamCPUTask, t: int,
                            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """enqueue_wait_with, both outputs brought to `device`: [T, H] float32 each."""
        mine, theirs = self.enqueue_wait_with(earlier, t)
        return mine.to(device, non_blocking=True), theirs.to(device, non_blocking=True)
