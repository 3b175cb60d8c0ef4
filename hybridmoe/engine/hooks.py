"""What the model runner and its CUDA graphs need from the MoE layers' shared runtime, and no more.

The runner never looks inside the hybrid MoE machinery (moe/runtime.py implements this): it asks
for a scope around each eager forward (layerwise prefill), records what a graph capture needs
replayed (queued CPU tasks), checks errors after a step, and asks whether a step's result should
be waited for sleeping. Models without a GPU/CPU split get `NoHooks`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class CaptureRecord:
    """Filled by `MoEHooks.capture` once a graph is captured: what to run before each replay."""

    before_replay: Callable[[], None] | None = None


class MoEHooks:
    """The interface (default: nothing to do)."""

    blocking_sync: bool = False  # read each step's result with a sleeping wait (a spinning host thread
    # would take a core that the CPU experts' threads need)

    @contextmanager
    def capture(self) -> Iterator[CaptureRecord]:
        """Around one CUDA graph capture."""
        yield CaptureRecord()

    @contextmanager
    def forward_scope(self, num_tokens: int) -> Iterator[bool]:
        """Around one eager model forward of `num_tokens` tokens (never around capture or replay);
        yields whether the forward takes a special path (layerwise prefill)."""
        yield False

    def check_errors(self) -> None:
        """After a step's results were read on the host: raise what failed out of sight in it."""

    def discard_failed_step(self) -> None:
        """After a forward that raised, on the CPU device: wait for its work still in flight and drop its
        errors, so that the next forward reports only its own."""


class NoHooks(MoEHooks):
    """For models whose MoE layers keep no shared runtime state."""
