"""A request's output as SGLang returns it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from hybridmoe.engine import prompt_logprobs
from hybridmoe.engine.request import Req


def formatted(req: Req, key: str, source: list, fmt: Callable[[Any], Any]) -> list:
    """[fmt(e) for e in source], a new list, with each entry formatted once over the request's life.

    The engine builds a request's output after every step it takes: formatting every logprob entry each time
    (and decoding its token for return_text_in_logprobs) was quadratic in the tokens, 58 ms a step for one
    request at 8000 tokens with 5 top logprobs (2-core Zen 4), stalling the whole batch. The source lists
    only grow (engine.py, pipeline.py appends; parallel.fork gives a fork its own copy), so entries past the
    ones formatted are the new ones. The list returned is a copy (pointers only): the output crosses to the
    server's thread while the engine appends."""
    cache = req.output_cache
    hit = cache.get(key)
    if hit is None or hit[0] is not source or len(hit[1]) > len(source):
        hit = cache[key] = (source, [])
    items = hit[1]
    if len(items) < len(source):
        items.extend(fmt(e) for e in source[len(items):])
    return list(items)


def output_dict(req: Req, tokenizer: Any = None) -> dict:
    """The SGLang-shaped output of a request: text, output_ids, meta_info (with logprobs when asked).

    Logprob entries are formatted once each (`formatted`): a step costs a copy of the lists' pointers, not a
    new entry (or a token decode) for every token so far."""
    meta = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "e2e_latency": (req.finished_time or time.time()) - req.arrival_time,
    }
    if req.return_logprob:
        def text(t: int) -> str | None:
            return tokenizer.decode([t]) if req.return_text_in_logprobs and tokenizer is not None else None

        texts = req.return_text_in_logprobs and tokenizer is not None  # part of the key: entries differ
        meta["output_token_logprobs"] = formatted(req, f"out{texts:d}", req.output_logprobs,
                                                  lambda e: [e[0], e[1], text(e[1])])
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = formatted(req, f"out_top{texts:d}", req.output_logprobs,
                                                    lambda e: [[v, t, text(t)] for v, t in e[2]])
        if req.logprob_start_len >= 0:
            meta.update(prompt_logprobs.meta(req, text, texts))
    return {"text": req.text, "output_ids": list(req.output_ids), "meta_info": meta}
