"""Per-request log lines (`--log-requests`), SGLang's levels (`--log-requests-level`):
0 ids and token counts, 1 also the sampling parameters, 2 also the first and last characters of
the prompt and output text, 3 the whole text and token ids."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

log = logging.getLogger("hybridmoe.requests")

PARTIAL_CHARS = 64


def _text(value: Any, level: int) -> str:
    s = repr(value)
    if level >= 3 or len(s) <= 2 * PARTIAL_CHARS:
        return s
    return f"{s[:PARTIAL_CHARS]}...{s[-PARTIAL_CHARS:]}"


def _params(req: Any) -> dict[str, Any]:
    """The sampling parameters that differ from the defaults."""
    p = req.params
    if not dataclasses.is_dataclass(p):
        return dict(vars(p))
    default = type(p)()
    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if getattr(p, f.name) != getattr(default, f.name)}


def log_received(req: Any, level: int) -> None:
    """One line when the engine takes a request."""
    parts = [f"rid={req.rid}", f"prompt_tokens={len(req.prompt_ids)}"]
    if level >= 1:
        parts.append(f"sampling_params={_params(req)}")
    if level >= 3:
        parts.append(f"input_ids={req.prompt_ids}")
    log.info("Receive: %s", ", ".join(parts))


def log_finished(req: Any, level: int) -> None:
    """One line when a request ends (any reason)."""
    latency = (req.finished_time or 0.0) - req.arrival_time
    parts = [f"rid={req.rid}", f"prompt_tokens={len(req.prompt_ids)}", f"completion_tokens={len(req.output_ids)}",
             f"cached_tokens={req.cached_tokens}", f"finish_reason={req.finish_reason}",
             f"e2e_latency={latency:.3f}s"]
    if req.admit_time is not None:
        parts.append(f"queue_time={req.admit_time - req.arrival_time:.3f}s")
    if level >= 2:
        parts.append(f"text={_text(req.text, level)}")
    if level >= 3:
        parts.append(f"output_ids={list(req.output_ids)}")
    log.info("Finish: %s", ", ".join(parts))
