"""Sampled ids that the host has not read yet (overlap scheduling, engine/pipeline.py).

Legend: B rows sampled in a step, R ring slots.

A step's sampled ids [B] are stored on the device in a ring (slots start..start+B-1) and copied to
pinned host memory behind an event, so the host can schedule and launch the next step before they
arrive. Until then a request carries the placeholder -slot in place of its token; the next step's
input ids are resolved on the device (`resolve`: a negative id reads the ring), so the host never
waits for the sample before launching. Slot 0 is never used: ids >= 0 are real tokens.

Ring size: step N+1 stores its ids after its forward read step N's slots (stream order), and the
host replaces step N's placeholders before it launches step N+2, so two steps' rows would do; the
ring holds three (a step's rows wrap to slot 1 only when they would pass the end, and then cannot
reach the previous step's slots).

Ring growth: the buffers start at INITIAL_ROWS rows per step (max_rows when smaller) and double, up
to max_rows, when a step samples more. --max-running-requests only bounds the rows; allocating for
it up front made --max-running-requests 2147483647 a 51 GB torch.zeros after the whole model load.
A step's rows are its running requests, each holding KV cache tokens of its own, so the ring never
grows past what the KV cache can run at once (a few bytes a row beside each request's KV pages).
Growing copies the old ring into the head of the new one: the placeholders still in flight keep
their slots, and the wrap argument above holds for the new row count.
"""

from __future__ import annotations

import torch

HOST_BUFFERS = 3  # pinned host copies in flight at most: step N is read before step N+2 is launched
INITIAL_ROWS = 256  # rows per step the buffers hold at first (the default --max-running-requests: no growth)


class HostIds:
    """One step's sampled ids on their way to the host."""

    def __init__(self, buf: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self._buf = buf  # [B] int64: pinned host (CUDA) or the ids themselves (CPU)
        self._event = event

    def read(self) -> list[int]:
        """The ids, once the step has run (sleeping on the event when it was made blocking)."""
        if self._event is not None:
            self._event.synchronize()
        return self._buf.tolist()


class FutureTokens:
    """The device ring of not-yet-read sampled ids and their copies to the host.

    max_rows: the most rows one step samples (--max-running-requests); the buffers hold fewer until
    a step needs more (see the module docstring). blocking: wait for a copy sleeping instead of
    spinning (hybrid MoE on CUDA: a spinning host thread takes a core the CPU experts need)."""

    def __init__(self, max_rows: int, device: torch.device, blocking: bool = False) -> None:
        self.max_rows = max(1, max_rows)
        self.device = device
        self._cuda = device.type == "cuda"
        self.rows = min(self.max_rows, INITIAL_ROWS)  # rows per step the buffers hold now
        self.ring = torch.zeros(3 * self.rows + 2, dtype=torch.int64, device=device)  # [R]
        self._next = 1
        self._host = self._new_host_buffers()
        self._events = [torch.cuda.Event(blocking=blocking) for _ in range(HOST_BUFFERS)] if self._cuda else []
        self._turn = 0

    def _new_host_buffers(self) -> list[torch.Tensor]:
        """The pinned host copies (CUDA only: on the CPU the sampled ids are the host copy)."""
        if not self._cuda:
            return []
        return [torch.empty(self.rows, dtype=torch.int64, pin_memory=True) for _ in range(HOST_BUFFERS)]

    def _grow(self, n: int) -> None:
        """Buffers for steps of `n` rows (n <= max_rows): doubled at least, so a batch that climbs
        step by step regrows only log2 times."""
        self.rows = min(self.max_rows, max(n, 2 * self.rows))
        ring = torch.zeros(3 * self.rows + 2, dtype=torch.int64, device=self.device)
        # the steps in flight keep their slots: their placeholders are resolved from the new ring (stream
        # order puts this copy after their stores)
        ring[:self.ring.shape[0]].copy_(self.ring)
        self.ring = ring
        # (a HostIds in flight holds a view of its old buffer, which stays alive until it is read)
        self._host = self._new_host_buffers()

    def publish(self, ids: torch.Tensor) -> tuple[int, HostIds]:  # ids [B]
        """Store a step's sampled ids in the ring and start their copy to the host; returns the first
        slot (row i is slot + i, placeholder -(slot + i)) and the host copy. Nothing waits."""
        n = ids.shape[0]
        if not 0 < n <= self.max_rows:
            raise ValueError(f"{n} sampled rows; the ring takes 1..{self.max_rows} per step")
        if n > self.rows:
            self._grow(n)
        if self._next + n > self.ring.shape[0]:
            self._next = 1
        slot, self._next = self._next, self._next + n
        ids = ids.to(torch.int64)
        # a NaN row's id (sampler.NAN_ROW, < 0) is 0 in the ring: its request may be computed once more before
        # the host reads the id and fails it, and an embedding lookup of a negative id would kill the device
        torch.clamp(ids, min=0, out=self.ring[slot:slot + n])
        if not self._cuda:  # the CPU computed them already: nothing to wait for
            return slot, HostIds(ids, None)
        k, self._turn = self._turn, (self._turn + 1) % HOST_BUFFERS
        buf = self._host[k][:n]
        buf.copy_(ids, non_blocking=True)
        self._events[k].record()
        return slot, HostIds(buf, self._events[k])

    def resolve(self, ids: torch.Tensor, host: list[int]) -> torch.Tensor:  # ids [T] int64 -> [T]
        """Input ids (host: the same ids as a host list) with each placeholder -slot replaced by the
        ring's slot, on the device. A decode batch of the previous step's rows in order is one slice."""
        slot = _run_of_slots(host)
        if slot:
            return self.ring[slot:slot + len(host)].clone()
        return torch.where(ids < 0, self.ring.index_select(0, ids.neg().clamp_(min=0)), ids)

    def resolve_(self, ids: torch.Tensor, host: list[int]) -> None:  # ids [T] int64, in place
        """`resolve` into the same buffer (a CUDA graph's static input ids)."""
        slot = _run_of_slots(host)
        ids.copy_(self.ring[slot:slot + len(host)] if slot else self.resolve(ids, host))


def _run_of_slots(host: list[int]) -> int:
    """s when host is the placeholders of slots s, s+1, ... in order (a decode batch of the previous
    step's sampled rows); else 0."""
    if not host or host[0] >= 0:
        return 0
    s = -host[0]
    return s if all(t == -(s + i) for i, t in enumerate(host)) else 0


def placeholder(slot: int) -> int:
    """The id a request carries for the token stored in ring slot `slot`."""
    return -slot
