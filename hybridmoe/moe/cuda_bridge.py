"""CPU expert tasks enqueued on a CUDA stream as host functions (cuLaunchHostFunc), so the CPU
side of a hybrid MoE layer is stream-ordered work: no Python runs between the GPU kernels, and a
decode step with CPU experts can be captured in a CUDA graph.

Legend: T tokens, K top-k, H hidden.

Fixed pinned buffers x_h [T, H], ids_h [T, K], w_h [T, K], out_h [T, H] (shared by the layers) and
one HostCall struct per (layer, T). On the stream: D2H copies into the buffers -> the start of the
CPU task -> the GPU's own work -> host function `hm_sync_hostfn` (blocks the stream until the task
is done) -> H2D copy of out_h. With deferral a layer's deferred task is queued right after its
immediate one, and one host function (`hm_sync2_hostfn`) waits for a layer's task and the
previous layer's deferred one (every host function is a trip through the driver's callback
thread, and the stream waits for it).

Two ways to start the CPU task (GATED_SUBMIT, HYBRIDMOE_GATED_SUBMIT=0 for the second):
- gated (default): the task is queued from Python at once and its start is gated on a pinned
  "go" word that a stream copy sets after the input copies; the pool's leader thread, idle
  anyway, polls it. The stream needs no host function for it. A captured decode graph replays no
  Python, so `record_submits` collects the gated submits of the capture and the graph's owner
  queues them (`SubmitProgram.submit`) before each replay.
- host function: `hm_submit_hostfn` queues the task when the stream reaches it.

libcuda is loaded at run time (never linked), and the host functions are C entry points of the
native library, so no Python runs inside them.
"""

from __future__ import annotations

import ctypes as C
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hybridmoe.cpu import native

_libcuda = None
# Gated submits (module docstring); read when a layer queues a task, so a benchmark can switch it
# between captures.
GATED_SUBMIT = os.environ.get("HYBRIDMOE_GATED_SUBMIT", "1") != "0"
_recording: list[tuple[native.HostCall, int | None, object]] | None = None


def libcuda():
    """The CUDA driver library, loaded at run time (never linked), with the entry points we call."""
    global _libcuda
    if _libcuda is None:
        lib = C.CDLL("libcuda.so.1")
        for name, args in (("cuLaunchHostFunc", [C.c_void_p, C.c_void_p, C.c_void_p]),
                           ("cuMemHostRegister_v2", [C.c_void_p, C.c_size_t, C.c_uint]),
                           ("cuMemHostUnregister", [C.c_void_p]),
                           ("cuMemHostGetFlags", [C.POINTER(C.c_uint), C.c_void_p])):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, C.c_int
        _libcuda = lib
    return _libcuda


def launch_host_func(fn_addr: int, userdata: C.Structure) -> None:
    """Enqueue fn(userdata) on the current CUDA stream (captured as a host node during capture)."""
    stream = torch.cuda.current_stream().cuda_stream
    rc = libcuda().cuLaunchHostFunc(C.c_void_p(stream), C.c_void_p(fn_addr), C.c_void_p(C.addressof(userdata)))
    if rc != 0:
        raise RuntimeError(f"cuLaunchHostFunc failed with CUDA error {rc}")


@contextmanager
def record_submits() -> Iterator[list]:
    """Around a CUDA graph capture: the gated submits the captured forward makes are collected, in
    order, instead of queued (the GPU runs nothing during capture); wrap the list in a
    SubmitProgram and submit it before every replay of that graph."""
    global _recording
    if _recording is not None:
        raise RuntimeError("record_submits is already active")
    _recording = []
    try:
        yield _recording
    finally:
        _recording = None


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


def _gated_submit(call: native.HostCall, go: torch.Tensor | None) -> None:
    """Queue `call`'s task now, started once `go` is set (None: not gated); recorded instead while
    a graph is captured."""
    go_ptr = None if go is None else go.data_ptr()
    if _recording is not None:
        _recording.append((call, go_ptr, go))
        return
    if go is not None and go.is_pinned() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a hybrid MoE layer was captured in a CUDA graph outside record_submits: "
                           "its CPU tasks would never be queued at replay")
    native.lib().hm_submit_gated(C.byref(call), go_ptr)


class PinnedIO:
    """Pinned host buffers for up to `cap` tokens: x [cap, H], ids [cap, K], w [cap, K], out [cap, H].

    Their addresses never change, so a captured graph keeps using them. Layers share them (the
    stream runs one layer after the other): see HybridPlan.pinned_io."""

    def __init__(self, cap: int, k: int, hidden: int, x_dtype: torch.dtype) -> None:
        self.cap = cap
        pin = torch.cuda.is_available()  # (False only in the CPU test that emulates the stream)
        self.x = torch.empty(cap, hidden, dtype=x_dtype, pin_memory=pin)  # [cap, H]
        self.ids = torch.full((cap, k), -1, dtype=torch.int32, pin_memory=pin)  # [cap, K]
        self.w = torch.zeros(cap, k, dtype=torch.float32, pin_memory=pin)  # [cap, K]
        self.out = torch.zeros(cap, hidden, dtype=torch.float32, pin_memory=pin)  # [cap, H]


class StreamCPUTask:
    """One layer's CPU expert task driven from a CUDA stream, on a PinnedIO's buffers; one HostCall
    per token count T points at their first T rows. `shared_input`: read x and w from that PinnedIO
    instead (a deferred task reads the immediate task's copies; only its ids are its own)."""

    def __init__(self, cpu_layer, io: PinnedIO, shared_input: PinnedIO | None = None) -> None:
        self.layer = cpu_layer
        self.io = io
        src = shared_input or io
        self.x, self.ids, self.w, self.out = src.x, io.ids, src.w, io.out
        self.calls: dict[int, native.HostCall] = {}
        # per T: submits queued without their wait queued yet (a forward interrupted in between
        # leaves 1: the next submit first queues the missed wait, so waits and submits stay paired)
        self.unsynced: dict[int, int] = {}
        pin = torch.cuda.is_available()
        self.go = torch.zeros(1, dtype=torch.int32, pin_memory=pin)  # set by the stream: the task may start
        self._one: torch.Tensor | None = None  # int32 [1] = 1 on the stream's device (the go copy's source)
        self.pairs: dict[tuple[int, int], native.HostCallPair] = {}  # (T, id(other)) -> pair
        self.submit_fn, self.sync_fn = native.host_functions()
        self.submit2_fn, self.sync2_fn = native.pair_host_functions()

    def _call(self, t: int) -> native.HostCall:
        call = self.calls.get(t)
        if call is None:
            task, _ = self.layer.make_task(self.x[:t], self.ids[:t], self.w[:t], self.out[:t])
            call = self.calls[t] = native.HostCall(self.layer.pool.handle, task, 0, 0, 0, 0)
        # (a failed task is reported with its message by the engine's check after the step:
        # HybridPlan.check_cpu_errors; the status flag only records it here)
        return call

    def _release(self, device: torch.device) -> None:
        """Stream-ordered, after the input copies: the go word that starts a gated task."""
        if self._one is None or self._one.device != device:
            self._one = torch.ones(1, dtype=torch.int32, device=device)
        self.go.copy_(self._one, non_blocking=True)

    def _begin_submit(self, t: int) -> None:
        if self.unsynced.get(t, 0):  # an interrupted forward's task: waited for before its buffers are reused
            launch_host_func(self.sync_fn, self._call(t))
        self.unsynced[t] = 1

    def enqueue_submit(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> None:
        """Copy the inputs out (stream-ordered) and start the CPU task once they have landed."""
        t = x.shape[0]
        self._begin_submit(t)
        self.x[:t].copy_(x, non_blocking=True)
        self.ids[:t].copy_(ids, non_blocking=True)
        self.w[:t].copy_(w, non_blocking=True)
        if GATED_SUBMIT:
            self._release(x.device)
            _gated_submit(self._call(t), self.go)
        else:
            launch_host_func(self.submit_fn, self._call(t))

    def enqueue_result(self, t: int, device: torch.device) -> torch.Tensor:
        """Block the stream until the task is done, then bring its output back: [T, H] float32."""
        launch_host_func(self.sync_fn, self._call(t))
        self.unsynced[t] = 0
        return self.out[:t].to(device, non_blocking=True)

    def _pair(self, t: int, other: StreamCPUTask) -> native.HostCallPair:
        key = (t, id(other))
        pair = self.pairs.get(key)
        if pair is None:  # both HostCalls live in their tasks' caches, as long as this pair
            pair = self.pairs[key] = native.HostCallPair(C.pointer(self._call(t)), C.pointer(other._call(t)))
        return pair

    def enqueue_submit_with(self, later: StreamCPUTask, x: torch.Tensor, ids: torch.Tensor,
                            later_ids: torch.Tensor, w: torch.Tensor) -> None:
        """This task and a deferred one that shares its x and w (built with shared_input=this
        task's PinnedIO): x and w copied once, both queued by one host function."""
        assert later.x.data_ptr() == self.x.data_ptr() and later.w.data_ptr() == self.w.data_ptr()
        t = x.shape[0]
        self._begin_submit(t)
        later._begin_submit(t)
        self.x[:t].copy_(x, non_blocking=True)
        self.ids[:t].copy_(ids, non_blocking=True)
        later.ids[:t].copy_(later_ids, non_blocking=True)
        self.w[:t].copy_(w, non_blocking=True)
        if GATED_SUBMIT:  # the deferred task is queued right behind the gated one: it needs no gate
            self._release(x.device)
            _gated_submit(self._call(t), self.go)
            _gated_submit(later._call(t), None)
        else:
            launch_host_func(self.submit2_fn, self._pair(t, later))

    def enqueue_result_with(self, earlier: StreamCPUTask, t: int,
                            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Block the stream until this task and `earlier` (submitted before it: the previous
        layer's deferred task) are done, with one host function; both outputs [T, H] float32."""
        launch_host_func(self.sync2_fn, self._pair(t, earlier))
        self.unsynced[t] = earlier.unsynced[t] = 0
        return self.out[:t].to(device, non_blocking=True), earlier.out[:t].to(device, non_blocking=True)
