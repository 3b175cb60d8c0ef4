"""The CUDA stream path of the hybrid MoE layers emulated on the CPU (tests only)."""

from __future__ import annotations

import ctypes as C
import time


def emulate_stream(monkeypatch) -> None:
    """Every hybrid layer takes the stream path, and host functions and memory operations run inline
    when enqueued (the order a stream would run them in): a wait polls its word (failing the test after
    30 s: on a GPU the stream would hang), a write sets it."""
    from hybridmoe.moe import cuda_bridge, hybrid

    def wait_value(addr: int, value: int) -> None:
        word, deadline = C.c_int32.from_address(addr), time.monotonic() + 30
        while word.value != value:
            assert time.monotonic() < deadline, "a memory-operation wait never saw its word set: the stream hangs"
            time.sleep(0)

    monkeypatch.setattr(cuda_bridge, "launch_host_func",
                        lambda fn, data: C.CFUNCTYPE(None, C.c_void_p)(fn)(C.addressof(data)))
    monkeypatch.setattr(cuda_bridge, "stream_wait_value32", wait_value)
    monkeypatch.setattr(cuda_bridge, "stream_write_value32",
                        lambda addr, value: setattr(C.c_int32.from_address(addr), "value", value))
    monkeypatch.setattr(hybrid, "_use_stream", lambda x: True)
