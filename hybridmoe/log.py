"""One log format for every process of hybridmoe: its own loggers and uvicorn's.

A line per event: `2025-01-31 12:00:00,123 INFO hybridmoe.server.run: message`. `configure` sets
the root logger once per process; `uvicorn_log_config` is the `log_config` handed to uvicorn so
that its loggers (uvicorn, uvicorn.error, uvicorn.access) write the same lines through the root
handler instead of installing their own formats.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_HANDLER_NAME = "hybridmoe"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of each record (not the one at creation: a
    test's captured stream may be closed by then)."""

    @property  # type: ignore[override]
    def stream(self):  # noqa: D102
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it
        pass


def configure(level: str = "info") -> None:
    """The root logger writes FORMAT lines to stderr at `level` (debug | info | warning | error);
    calling again only changes the level (no duplicate handlers). A root logger that already has
    other handlers is left alone, like logging.basicConfig does."""
    root = logging.getLogger()
    if any(h.get_name() != _HANDLER_NAME for h in root.handlers):
        return  # configured by someone else (an embedding program, pytest's capture): leave it, as basicConfig does
    root.setLevel(level.upper())
    if root.handlers:
        return
    handler = _StderrHandler()
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(handler)


def uvicorn_log_config(level: str = "info") -> dict[str, Any]:
    """uvicorn's loggers with no handlers of their own, propagating to the root (FORMAT)."""
    lvl = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "loggers": {name: {"handlers": [], "level": lvl, "propagate": True}
                    for name in ("uvicorn", "uvicorn.error", "uvicorn.access")},
    }
