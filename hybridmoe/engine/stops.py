"""Stop strings: where a request's detokenized text ends."""

from __future__ import annotations

from hybridmoe.engine.request import Req, finish_stop


def match_stop_str(req: Req, new_len: int) -> dict | None:
    """The earliest stop string in the text's new tail (new_len characters, plus what a stop string
    could straddle): req.text cut there (kept with no_stop_trim) and its finish reason; else None."""
    longest = max(len(s) for s in req.params.stop_strs)
    tail_start = max(0, len(req.text) - new_len - longest + 1)
    best = None
    for s in req.params.stop_strs:
        j = req.text.find(s, tail_start)
        if j >= 0 and (best is None or j < best[0]):
            best = (j, s)
    if best is None:
        return None
    j, s = best
    if not req.params.no_stop_trim:
        req.text = req.text[:j]
    else:
        req.text = req.text[: j + len(s)]
    return finish_stop(s)
