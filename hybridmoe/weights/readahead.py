"""Checkpoint bytes off the disk fast: the next decoder layer read ahead while the current one is
packed, and tensors read straight into their destination.

The loader copies each layer's tensors out of the safetensors files and then quantizes the experts
(seconds of CPU work a layer). From a cold page cache every first read waits for the disk, one
readahead window at a time. Here a daemon thread reads the next layer's byte ranges into a small
scratch buffer, which leaves them in the page cache, so the disk works while the CPU quantizes.
(posix_fadvise WILLNEED was tried first: on the 2-core CI-like machine, ext4 on virtio, it returned
in 2 ms and a read 3 s later still ran at disk speed, so the thread reads.) Only one layer ahead: the
page cache holds at most that much more than the loader would have read anyway. Failures here are
ignored: the loader reads, and reports, the file itself.

`read_into` fills a CPU tensor with positioned reads (os.preadv) instead of copying from the mmap:
no page fault per 4 KB page, and no second pass over the bytes.
"""

import os
import queue
import re
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from hybridmoe.weights.shards import read_header

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_MERGE_GAP = 1 << 20  # ranges closer than this are read as one (the norms between the big tensors)
_CHUNK = 1 << 30  # bytes per preadv (Linux returns at most ~2 GB a call)
_SCRATCH = 16 << 20  # the read-ahead thread's buffer


class TensorSpan(NamedTuple):
    dtype: str  # the header's code: BF16, F32, ...
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def tensor_spans(path: Path) -> dict[str, TensorSpan]:
    """Each tensor of a safetensors file: dtype code, shape and absolute byte range, from its header.
    Raises CheckpointError (a ValueError), KeyError or TypeError for a file that is not one."""
    header, base = read_header(path)
    return {k: TensorSpan(v["dtype"], tuple(v["shape"]), base + v["data_offsets"][0], base + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


def read_into(fd: int, start: int, end: int, dst: torch.Tensor) -> None:
    """Bytes [start, end) of file descriptor fd into contiguous CPU tensor dst (exactly that many
    bytes). Raises EOFError when the file ends first (a truncated checkpoint)."""
    buf = memoryview(dst.view(-1).view(torch.uint8).numpy())
    assert len(buf) == end - start
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:done + _CHUNK]], start + done)
        if n <= 0:
            raise EOFError(f"the file ends at byte {start + done}, inside a tensor ending at byte {end}")
        done += n


def merged(ranges: list[tuple[int, int]], gap: int = _MERGE_GAP) -> list[tuple[int, int]]:
    """Sorted ranges with those less than `gap` apart joined."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(ranges):
        if out and s - out[-1][1] < gap:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


class LayerReadahead:
    """`layer(i)` queues layer i's tensors (names with `layers.{i}.`, less those containing `skip`)
    to be read ahead into the page cache; returns at once. Headers are parsed once per file, in the
    thread."""

    def __init__(self, file_of: dict[str, Path], skip: str | None = None) -> None:
        self._by_layer: dict[int, dict[Path, list[str]]] = {}
        for name, f in file_of.items():
            m = _LAYER.search(name)
            if m and not (skip and skip in name):
                self._by_layer.setdefault(int(m.group(1)), {}).setdefault(f, []).append(name)
        self._headers: dict[Path, dict[str, TensorSpan]] = {}
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.ahead_bytes = 0  # bytes read ahead (tests)

    def layer(self, i: int) -> None:
        if i not in self._by_layer:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hm-readahead", daemon=True)
            self._thread.start()
        self._queue.put(i)

    def close(self, wait: bool = True) -> None:
        """Stop the thread: after the queued layers (wait), or at its next chunk (not wait: the load
        failed). Waits for it either way."""
        if self._thread is not None:
            if not wait:
                self._stop.set()
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        scratch = memoryview(bytearray(_SCRATCH))
        while (i := self._queue.get()) is not None:
            for f, names in self._by_layer[i].items():
                try:
                    self._read(f, names, scratch)
                except (OSError, ValueError, KeyError, TypeError):
                    pass  # only a head start: the loader reads (and reports) the file itself

    def _read(self, f: Path, names: list[str], scratch: memoryview) -> None:
        ranges = self._headers.get(f)
        if ranges is None:
            ranges = self._headers[f] = tensor_spans(f)
        fd = os.open(f, os.O_RDONLY)
        try:
            for s, e in merged([ranges[n][2:] for n in names if n in ranges]):
                while s < e and not self._stop.is_set():
                    n = os.preadv(fd, [scratch[:min(len(scratch), e - s)]], s)
                    if n <= 0:
                        return
                    s += n
                    self.ahead_bytes += n
        finally:
            os.close(fd)
