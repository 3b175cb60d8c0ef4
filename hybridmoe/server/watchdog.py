"""`--watchdog-timeout`: an engine step (one forward, sampling, outputs) that runs longer than this
means the engine hangs (a stuck kernel, a CPU expert task that never ends, a deadlock). The server
then logs the engine thread's stack and exits with status 1, so a supervisor (systemd, Kubernetes,
sglang-router's health checks) restarts it instead of leaving a server that accepts requests and
never answers.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger(__name__)


def _exit_now() -> None:
    logging.shutdown()  # flush the handlers: the stack above must reach the log
    os._exit(1)


class StepWatchdog:
    """Watches the engine thread's steps: `begin()` before a step, `end()` after it."""

    def __init__(self, timeout: float, on_timeout: Callable[[], None] = _exit_now) -> None:
        self.timeout = timeout
        self.on_timeout = on_timeout
        self.fired = False
        self._started: float | None = None
        self._engine_thread: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start watching; the calling thread is the engine thread whose stack is logged."""
        self._engine_thread = threading.get_ident()
        self._thread = threading.Thread(target=self._run, name="hybridmoe-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def begin(self) -> None:
        self._started = time.monotonic()

    def end(self) -> None:
        self._started = None

    def _run(self) -> None:
        poll = min(1.0, self.timeout / 4)
        while not self._stop.wait(poll):
            started = self._started
            if started is None or time.monotonic() - started <= self.timeout:
                continue
            frame = sys._current_frames().get(self._engine_thread or -1)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(not available)\n"
            log.error("watchdog: an engine step has run for more than %g s (--watchdog-timeout); the engine "
                      "hangs, exiting. The engine thread's stack:\n%s", self.timeout, stack.rstrip())
            self.fired = True
            self.on_timeout()
            return
