"""`--log-requests`: one line when a request is received and one when it finishes, with as much of it
as `--log-requests-level` says (SGLang's levels):
0 metadata (rid, token counts, finish reason, latency); 1 + sampling parameters; 2 + the first and
last characters of the output text and the first and last prompt token ids; 3 + all of them.

Receive and Finish lines pair up by rid: a request with n > 1 sequences finishes each under its own rid
(X, X-1, ..., engine/parallel.py), so each gets its own Receive line too. The first one (rid=X) says n=K;
a fork's (rid=X-i) names the request it was forked from (fork_of=X) and, from level 1, its own sampling
parameters (its seed differs); its prompt is that request's, logged once on the first line.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from hybridmoe.engine.request import Req

log = logging.getLogger("hybridmoe.requests")

PARTIAL_CHARS = 128  # level 2: this many characters (or token ids) from each end
PARTIAL_IDS = 32


def _partial(seq: Any, n: int) -> str:
    if len(seq) <= 2 * n:
        return repr(seq)
    if isinstance(seq, str):
        return repr(seq[:n]) + f" ... ({len(seq) - 2 * n} chars) ... " + repr(seq[-n:])
    return f"{list(seq[:n])} ... ({len(seq) - 2 * n} ids) ... {list(seq[-n:])}"


def received_line(req: Req, level: int) -> str:
    parts = [f"rid={req.rid}"]
    if req.forks:  # n > 1: the forks' lines follow (received_lines); params.n is 1 once they are made
        parts.append(f"n={1 + len(req.forks)}")
    parts.append(f"prompt_tokens={len(req.prompt_ids)}")
    if level >= 1:
        parts.append(f"sampling_params={dataclasses.asdict(req.params)}")
    if level == 2:
        parts.append(f"input_ids={_partial(req.prompt_ids, PARTIAL_IDS)}")
    elif level >= 3:
        parts.append(f"input_ids={req.prompt_ids}")
    return "Receive: " + ", ".join(parts)


def finished_line(out: dict[str, Any], level: int) -> str:
    meta = out["meta_info"]
    parts = [f"rid={meta['id']}", f"finish_reason={meta['finish_reason']}", f"prompt_tokens={meta['prompt_tokens']}",
             f"completion_tokens={meta['completion_tokens']}", f"cached_tokens={meta['cached_tokens']}",
             f"e2e_latency={meta['e2e_latency']:.3f}s"]
    if level == 2:
        parts.append(f"text={_partial(out.get('text', ''), PARTIAL_CHARS)}")
    elif level >= 3:
        parts.append(f"text={out.get('text', '')!r}")
        parts.append(f"output_ids={out.get('output_ids', [])}")
    return "Finish: " + ", ".join(parts)


def fork_received_line(fork: Req, parent: Req, level: int) -> str:
    parts = [f"rid={fork.rid}", f"fork_of={parent.rid}", f"prompt_tokens={len(fork.prompt_ids)}"]
    if level >= 1:
        parts.append(f"sampling_params={dataclasses.asdict(fork.params)}")
    return "Receive: " + ", ".join(parts)


def received_lines(req: Req, level: int) -> list[str]:
    """One line per sequence of the request: its own, then each fork's (n > 1), in rid order."""
    return [received_line(req, level)] + [fork_received_line(f, req, level) for f in req.forks]


def log_received(req: Req, level: int) -> None:
    for line in received_lines(req, level):
        log.info("%s", line)


def log_finished(out: dict[str, Any], level: int) -> None:
    log.info("%s", finished_line(out, level))
