"""`--log-requests`: one line when a request is received and one when it finishes, with as much of it
as `--log-requests-level` says (SGLang's levels):
0 metadata (rid, token counts, finish reason, latency); 1 + sampling parameters; 2 + the first and
last characters of the output text and the first and last prompt token ids; 3 + all of them.
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
    parts = [f"rid={req.rid}", f"prompt_tokens={len(req.prompt_ids)}"]
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


def log_received(req: Req, level: int) -> None:
    log.info("%s", received_line(req, level))


def log_finished(out: dict[str, Any], level: int) -> None:
    log.info("%s", finished_line(out, level))
