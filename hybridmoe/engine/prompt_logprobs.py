"""Prompt logprobs: the logprob of each prompt token from `logprob_start_len` on, computed in the
prefill forward only for the requests that ask.

Legend: T new tokens of the step, R scored rows, H hidden, V vocabulary, K top logprobs.

The entry of the token at `logprob_start_len` is None (as SGLang returns it); the token at position
p > start is scored by the logits of position p - 1, so the hidden rows wanted are the positions
[start, L - 1) of a prompt of L tokens. A request's entries grow chunk by chunk (chunked prefill);
`next_row` says which position it needs next.

Prefix cache: positions inside a cached prefix have no hidden state. The choice made here (SGLang
makes the same): a request scoring its prompt reuses only the cached pages that end at or before
its next wanted position (`cache_limit`, also after a preemption) and recomputes the rest; the
recomputed pages equal the cached ones, and release() frees such duplicates instead of caching them
twice. So `lm-eval`-style requests scoring from position 0 get no prefix reuse (cached_tokens 0),
and sgl.select's, scoring from two tokens before the shared prefix's end, reuse the prefix's pages.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridmoe.engine.formatted import formatted
from hybridmoe.engine.request import Req

# Rows whose full-vocabulary logits exist at once: bounds the memory of a long prompt's scoring
# (at most ROW_CHUNK rows and about 64M fp32 logits, 256 MB, per chunk).
ROW_CHUNK = 512
MAX_CHUNK_ELEMENTS = 1 << 26


def start(req: Req) -> None:
    """Set up the entries of a request that asks for prompt logprobs (after validation)."""
    if req.return_logprob and req.logprob_start_len >= 0 and not req.input_logprobs:
        s = req.logprob_start_len
        req.input_logprobs.append((None, req.prompt_ids[s], None))


def next_row(req: Req) -> int | None:
    """The next prompt position whose hidden row is wanted, or None when nothing more is."""
    if not req.input_logprobs:
        return None
    pos = req.logprob_start_len + len(req.input_logprobs) - 1
    return pos if pos < len(req.prompt_ids) - 1 else None


def cache_limit(req: Req) -> list[int]:
    """The tokens the prefix cache may serve for req: all of them, or those before its next wanted row
    (match_prefix leaves the last token of what it is given to compute)."""
    row = next_row(req)
    return req.all_ids if row is None else req.all_ids[: row + 1]


def wanted_rows(reqs: list[Req], num_tokens: list[int]) -> list[tuple[Req, int, int, int]]:
    """(req, first row in the step's tokens, first position, count) for each live request scored in
    this step (call before the step's num_computed advance)."""
    out, offset = [], 0
    for req, n in zip(reqs, num_tokens):
        if n <= 0:
            continue
        row = next_row(req)
        if row is not None:
            lo = max(row, req.num_computed)
            hi = min(req.num_computed + n, len(req.prompt_ids) - 1)
            if hi > lo and lo == row:  # lo > row would skip positions: never, cache_limit prevents it
                out.append((req, offset + lo - req.num_computed, lo, hi - lo))
        offset += n
    return out


@torch.inference_mode()
def compute(hidden: torch.Tensor, wanted: list[tuple[Req, int, int, int]],
            logits_fn: Callable[[torch.Tensor], torch.Tensor], vocab_size: int) -> list[tuple[Req, list]]:
    """Entries for the wanted rows of hidden [T, H]: (req, [(logprob, token, top)]) per request.

    The LM head and log_softmax run on ROW_CHUNK rows at a time; the results go to the host once.
    """
    if not wanted:
        return []
    dev = hidden.device
    rows = torch.tensor([r for _, first, _, cnt in wanted for r in range(first, first + cnt)], device=dev)
    targets = torch.tensor([req.prompt_ids[p + 1] for req, _, pos, cnt in wanted for p in range(pos, pos + cnt)],
                           device=dev)
    k = max(req.top_logprobs_num for req, _, _, _ in wanted)
    chosen, top_v, top_i = [], [], []
    step = max(1, min(ROW_CHUNK, MAX_CHUNK_ELEMENTS // max(vocab_size, 1)))
    for a in range(0, rows.numel(), step):
        h = hidden[rows[a:a + step]]  # [r, H]
        lp = torch.log_softmax(logits_fn(h)[:, :vocab_size].float(), dim=-1)  # [r, V]
        chosen.append(lp.gather(1, targets[a:a + step, None])[:, 0])
        if k > 0:
            v, i = torch.topk(lp, min(k, vocab_size), dim=-1)  # [r, K]
            top_v.append(v)
            top_i.append(i)
    chosen_l = torch.cat(chosen).tolist()
    top_vl = torch.cat(top_v).tolist() if k > 0 else None
    top_il = torch.cat(top_i).tolist() if k > 0 else None
    targets_l = targets.tolist()
    out, j = [], 0
    for req, _, _, cnt in wanted:
        kr = req.top_logprobs_num
        entries = []
        for _ in range(cnt):
            top = list(zip(top_vl[j][:kr], top_il[j][:kr])) if kr and top_vl is not None and top_il is not None \
                else None
            entries.append((chosen_l[j], targets_l[j], top))
            j += 1
        out.append((req, entries))
    return out


def meta(req: Req, text: Callable[[int], str | None], texts: bool = False) -> dict:
    """The meta_info fields of a request's prompt logprobs (SGLang's shapes); each entry formatted once over the
    request's life (formatted.py; `texts`: whether `text` decodes, part of the cache key)."""
    entries = req.input_logprobs
    cache = req.output_cache
    done, total, count = cache.get("in_sum", (0, 0.0, 0))
    if done > len(entries):  # a new list (a fork's copy is as long): start over
        done, total, count = 0, 0.0, 0
    for lp, _, _ in entries[done:]:
        if lp is not None:
            total, count = total + lp, count + 1
    cache["in_sum"] = (len(entries), total, count)
    out: dict = {
        "input_token_logprobs": formatted(req, f"in{texts:d}", entries, lambda e: [e[0], e[1], text(e[1])]),
        # SGLang's older field (sgl.select read it): the mean over the scored prompt tokens
        "normalized_prompt_logprob": total / count if count else 0.0,
    }
    if req.top_logprobs_num:
        out["input_top_logprobs"] = formatted(req, f"in_top{texts:d}", entries,
                                              lambda e: None if e[2] is None else [[v, t, text(t)] for v, t in e[2]])
    return out
