"""The CUDA driver API calls hybridmoe makes directly: libcuda loaded at run time (never linked),
host functions and memory operations (wait for / write a pinned word) enqueued on the current
stream, and page-locking CPU tensors in place.

torch covers the rest of CUDA; these it does not expose. Nothing here runs without a driver
except the bookkeeping (tests replace `libcuda`).
"""

from __future__ import annotations

import ctypes as C
import logging
import mmap
import weakref

import torch

log = logging.getLogger(__name__)

CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
CU_MEMHOSTREGISTER_READ_ONLY = 0x08  # cuda.h: the device only reads the range (needed for a PROT_READ mapping)

_libcuda = None
_warned = False
_locked: list[tuple[int, int]] = []  # page ranges registered by page_lock, sorted


def libcuda():
    """The CUDA driver library, loaded at run time (never linked), with the entry points we call.
    Raises OSError where there is none."""
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
    """Enqueue fn(userdata) on the current CUDA stream (captured as a host node during capture).
    fn_addr: a CUhostFn (void fn(void*)) that runs no Python; userdata must outlive the call."""
    stream = torch.cuda.current_stream().cuda_stream
    rc = libcuda().cuLaunchHostFunc(C.c_void_p(stream), C.c_void_p(fn_addr), C.c_void_p(C.addressof(userdata)))
    if rc != 0:
        raise RuntimeError(f"cuLaunchHostFunc failed with CUDA error {rc}")


# ---- stream memory operations on pinned words ------------------------------------------------------
CU_STREAM_WAIT_VALUE_EQ = 0x1  # cuda.h CUstreamWaitValue_flags


def _memop(name: str):
    """The driver's entry point `name` (its _v2 form first: CUDA 12 renamed the memory operations and
    later drivers may export only that), or None."""
    lib = libcuda()
    for sym in (f"{name}_v2", name):
        fn = getattr(lib, sym, None)
        if fn is not None:
            return fn
    return None


def stream_memops_supported() -> bool:
    """Whether cuStreamWaitValue32 / cuStreamWriteValue32 can be used: CUDA 12 drivers support them
    everywhere (before, a module option enabled them); a driver without the entry points cannot."""
    try:
        lib, ver = libcuda(), C.c_int()
        if lib.cuDriverGetVersion(C.byref(ver)) != 0 or ver.value < 12000:
            return False
        return all(_memop(n) is not None for n in ("cuStreamWaitValue32", "cuStreamWriteValue32",
                                                  "cuMemHostGetDevicePointer"))
    except OSError:
        return False


def host_device_pointer(t: torch.Tensor) -> int:
    """The device address of a pinned (page-locked) host tensor's first byte, for stream memory
    operations on it."""
    fn, ptr = _memop("cuMemHostGetDevicePointer"), C.c_uint64()
    rc = fn(C.byref(ptr), C.c_void_p(t.data_ptr()), C.c_uint(0))
    if rc != 0:
        raise RuntimeError(f"cuMemHostGetDevicePointer failed with CUDA error {rc} (is the tensor pinned?)")
    return ptr.value


def stream_wait_value32(addr: int, value: int) -> None:
    """Enqueue on the current stream: wait until the int32 at device address `addr` equals `value`
    (the GPU polls it; captured as a memory-operation node during capture)."""
    stream = torch.cuda.current_stream().cuda_stream
    rc = _memop("cuStreamWaitValue32")(C.c_void_p(stream), C.c_uint64(addr), C.c_uint32(value),
                                       C.c_uint(CU_STREAM_WAIT_VALUE_EQ))
    if rc != 0:
        raise RuntimeError(f"cuStreamWaitValue32 failed with CUDA error {rc}")


def stream_write_value32(addr: int, value: int) -> None:
    """Enqueue on the current stream: write `value` to the int32 at device address `addr`, after the
    stream's earlier work (captured as a memory-operation node during capture)."""
    stream = torch.cuda.current_stream().cuda_stream
    rc = _memop("cuStreamWriteValue32")(C.c_void_p(stream), C.c_uint64(addr), C.c_uint32(value), C.c_uint(0))
    if rc != 0:
        raise RuntimeError(f"cuStreamWriteValue32 failed with CUDA error {rc}")


# ---- page-locking CPU tensors in place ------------------------------------------------------------
def is_page_locked(t: torch.Tensor) -> bool:
    """Whether the driver sees t's first and last bytes as page-locked host memory. (torch's
    Tensor.is_pinned looks at the start of the tensor's storage, which for a page-aligned view
    (cpu.quant.page_aligned) lies before the locked pages.)"""
    if t.nbytes == 0:
        return True
    lib, flags = libcuda(), C.c_uint()
    return all(lib.cuMemHostGetFlags(C.byref(flags), C.c_void_p(p)) == 0
               for p in (t.data_ptr(), t.data_ptr() + t.nbytes - 1))


def _unregister(ranges: list[tuple[int, int]]) -> None:
    try:
        lib = libcuda()
        for r in ranges:
            lib.cuMemHostUnregister(C.c_void_p(r[0]))
            _locked.remove(r)
    except Exception:  # interpreter or driver shutting down
        pass


def _gaps(lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of [lo, hi) not registered yet."""
    out = []
    for a, b in _locked:
        if b <= lo or a >= hi:
            continue
        if a > lo:
            out.append((lo, a))
        lo = max(lo, b)
    if lo < hi:
        out.append((lo, hi))
    return out


def page_lock(owner: object, tensors: list[torch.Tensor], device: torch.device, read_only: bool = False) -> bool:
    """Page-locks the memory of CPU tensors in place (cuMemHostRegister: the driver-API twin of
    cudaHostRegister, which leaves the runtime's last-error state alone), never copying them, so
    H2D copies from them are DMA at full speed. The tensors must own their pages (CPUExperts'
    page_align: a page shared with other memory would be only partly locked, and DMA from such a
    range fails with "invalid argument"). Whole pages are registered, each once per process
    (tensors of several layers may share a page); unregistered when `owner` is collected (before
    the tensors are freed, as long as `owner` holds them). False (with one warning per process)
    where it fails: the copies then read pageable memory, correct but several times slower.
    read_only: registered with CU_MEMHOSTREGISTER_READ_ONLY, which a read-only mapping (a GGUF file's
    pages) needs; the GPU then only reads the range."""
    global _warned
    page = mmap.PAGESIZE
    spans = sorted((t.data_ptr() // page * page, -(-(t.data_ptr() + t.nbytes) // page) * page)
                   for t in tensors if t.nbytes)
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    todo = [g for lo, hi in merged for g in _gaps(lo, hi)]
    if not todo:
        return True
    torch.zeros(1, device=device)  # the primary context is current on this thread
    mine: list[tuple[int, int]] = []
    rc = 0
    try:
        lib = libcuda()
        for lo, hi in todo:
            rc = lib.cuMemHostRegister_v2(C.c_void_p(lo), hi - lo, CU_MEMHOSTREGISTER_READ_ONLY if read_only else 0)
            if rc == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:  # page-locked by someone else
                rc = 0
            elif rc == 0:
                mine.append((lo, hi))
            else:
                break
    except OSError as e:
        rc = -1
        log.debug("libcuda: %s", e)
    if mine:
        _locked.extend(mine)
        _locked.sort()
        weakref.finalize(owner, _unregister, mine).atexit = False
    if rc != 0 and not _warned:
        _warned = True
        log.warning("layerwise prefill: cannot page-lock the CPU expert weights (CUDA error %d); copying them "
                    "from pageable memory (slower)", rc)
    return rc == 0
