"""A request's output as SGLang returns it."""

from __future__ import annotations

import time
from typing import Any

from hybridmoe.engine import prompt_logprobs
from hybridmoe.engine.formatted import formatted
from hybridmoe.engine.request import Req


def output_dict(req: Req, tokenizer: Any = None) -> dict:
    """The SGLang-shaped output of a request: text, output_ids, meta_info (with logprobs when asked).

    Logprob entries are formatted once each (formatted.py): a step costs a copy of the lists' pointers, not a
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
