"""A request's output as SGLang returns it."""

from __future__ import annotations

import time
from typing import Any

from hybridmoe.engine import prompt_logprobs
from hybridmoe.engine.request import Req


def output_dict(req: Req, tokenizer: Any = None) -> dict:
    """The SGLang-shaped output of a request: text, output_ids, meta_info (with logprobs when asked)."""
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

        meta["output_token_logprobs"] = [[lp, tok, text(tok)] for lp, tok, _ in req.output_logprobs]
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = [[[v, t, text(t)] for v, t in top] for _, _, top in req.output_logprobs]
        if req.logprob_start_len >= 0:
            meta.update(prompt_logprobs.meta(req, text))
    return {"text": req.text, "output_ids": list(req.output_ids), "meta_info": meta}
