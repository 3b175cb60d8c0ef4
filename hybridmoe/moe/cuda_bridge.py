"""CPU expert tasks enqueued on a CUDA stream as host functions (cuLaunchHostFunc), so the CPU
side of a hybrid MoE layer is stream-ordered work: no Python runs between the GPU kernels, and a
decode step with CPU experts can be captured in a CUDA graph.

Legend: T tokens, K top-k, H hidden.

Fixed pinned buffers x_h [T, H], ids_h [T, K], w_h [T, K], out_h [T, H] (shared by the layers) and
one HostCall struct per (layer, T). On the stream: D2H copies into the buffers -> host function `hm_submit_hostfn`
(queues the task on the CPU pool and returns) -> the GPU's own work -> host function
`hm_sync_hostfn` (blocks the stream until the task is done) -> H2D copy of out_h. With deferral
the pair forms queue a layer's two tasks, and wait for a layer's task and the previous layer's
deferred one, with one host function each (every host function is a trip through the driver's
callback thread). libcuda is
loaded at run time (never linked), and the host functions are C entry points of the native
library, so no Python runs inside them.
"""

from __future__ import annotations

import ctypes as C

import torch

from hybridmoe.cpu import native

_libcuda = None


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

    def enqueue_submit(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> None:
        """Copy the inputs out (stream-ordered) and queue the CPU task once they have landed."""
        t = x.shape[0]
        self.x[:t].copy_(x, non_blocking=True)
        self.ids[:t].copy_(ids, non_blocking=True)
        self.w[:t].copy_(w, non_blocking=True)
        launch_host_func(self.submit_fn, self._call(t))

    def enqueue_result(self, t: int, device: torch.device) -> torch.Tensor:
        """Block the stream until the task is done, then bring its output back: [T, H] float32."""
        launch_host_func(self.sync_fn, self._call(t))
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
        self.x[:t].copy_(x, non_blocking=True)
        self.ids[:t].copy_(ids, non_blocking=True)
        later.ids[:t].copy_(later_ids, non_blocking=True)
        self.w[:t].copy_(w, non_blocking=True)
        launch_host_func(self.submit2_fn, self._pair(t, later))

    def enqueue_result_with(self, earlier: StreamCPUTask, t: int,
                            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Block the stream until this task and `earlier` (submitted before it: the previous
        layer's deferred task) are done, with one host function; both outputs [T, H] float32."""
        launch_host_func(self.sync2_fn, self._pair(t, earlier))
        return self.out[:t].to(device, non_blocking=True), earlier.out[:t].to(device, non_blocking=True)
