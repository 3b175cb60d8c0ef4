"""The CPU-only decode step on the pool leader's CPU.

CPU-only decode runs the pool's phases inline: the thread that steps the engine leads them in the
leader thread's place (hm_run_task), while every core also carries one pinned pool thread. Left
free, the stepping thread lands on some core whose pool thread spins after each phase and shares
it. For a decode step (the one-call layers, the LM head) that thread is moved onto the leader's CPU,
and the leader thread sleeps as soon as its queue is empty (leader spin 0), so the core is the
stepping thread's alone. Pinning a whole benchmark round that way was 4-5% faster in 13 of 15
interleaved rounds on the H200 host (16 cores; benchmarks/results/NOTES_h200_session15_2026-12-05.md:
`pinned0`), mixed on a 2-core machine (1.008 and 0.835). Pinned step by step, as here, it measured the
same as unpinned on the H200 host (per-round median 0.998 over 6 rounds, NOTES_h200_session16): so it is
off by default, switched on by $HYBRIDMOE_PIN_CALLER=1 (development) or `enabled`.

The thread's own CPU mask is restored after the step: torch's OpenMP workers are created by the
thread that first runs a parallel region and inherit its mask, so prefill (torch ops, every core)
must never start on one CPU. Decode steps run no parallel torch region (one to four rows).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from hybridmoe import envs

log = logging.getLogger(__name__)

def wanted() -> bool:
    """Whether decode steps are pinned: off unless $HYBRIDMOE_PIN_CALLER=1 (module docstring)."""
    return bool(envs.pin_caller())


class CallerPin:
    """Moves the calling thread onto `pool`'s leader CPU for a decode step (`with pin():`) and sets the
    leader's spin to 0 while enabled. `enabled` may be switched (benchmarks compare both)."""

    def __init__(self, pool, enabled: bool) -> None:
        self.pool = pool
        cpus = list(getattr(pool, "cpus", []) or [])
        self.cpu: int | None = cpus[0] if cpus and cpus[0] >= 0 else None
        self._enabled = False
        self._spin_was = -1
        self.steps = 0  # steps run pinned (tests, benchmarks)
        self.enabled = enabled

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        on = bool(on) and self.cpu is not None
        if on == self._enabled:
            return
        if on:
            self._spin_was = self.pool.leader_spin_us
            self.pool.leader_spin_us = 0
        else:
            self.pool.leader_spin_us = self._spin_was
        self._enabled = on

    @contextmanager
    def __call__(self) -> Iterator[None]:
        if not self._enabled:
            yield
            return
        was = os.sched_getaffinity(0)
        if was == {self.cpu}:
            yield
            return
        try:
            os.sched_setaffinity(0, {self.cpu})
        except OSError as e:  # the leader's CPU left this process's mask (taskset, cgroup change)
            log.warning("CPU-only decode: cannot pin the stepping thread to CPU %d (%s); pinning off", self.cpu, e)
            self.enabled = False
            yield
            return
        try:
            self.steps += 1
            yield
        finally:
            os.sched_setaffinity(0, was)
