"""A request's output, built after every engine step, formats each logprob entry once (engine/formatted.py).

It rebuilt every entry of the output and prompt logprobs (and decoded each one's token for
return_text_in_logprobs) at every step: quadratic in the tokens, 58 ms a step for one request at 8000
tokens with 5 top logprobs on a 2-core Zen 4, during which the engine stepped no request."""

from __future__ import annotations

import random

from hybridmoe.engine.outputs import output_dict
from hybridmoe.engine.request import Req, SamplingParams


class CountingTokenizer:
    def __init__(self) -> None:
        self.calls = 0

    def decode(self, ids: list[int]) -> str:
        self.calls += 1
        return f"<{ids[0]}>"


def _naive(req: Req, tok: CountingTokenizer | None) -> dict:
    """The output as formatted from scratch (what output_dict built every step before)."""
    def text(t: int) -> str | None:
        return f"<{t}>" if req.return_text_in_logprobs and tok is not None else None

    meta = {"output_token_logprobs": [[lp, t, text(t)] for lp, t, _ in req.output_logprobs]}
    if req.top_logprobs_num:
        meta["output_top_logprobs"] = [[[v, t, text(t)] for v, t in top] for _, _, top in req.output_logprobs]
    if req.logprob_start_len >= 0:
        scored = [lp for lp, _, _ in req.input_logprobs if lp is not None]
        meta["input_token_logprobs"] = [[lp, t, text(t)] for lp, t, _ in req.input_logprobs]
        meta["normalized_prompt_logprob"] = sum(scored) / len(scored) if scored else 0.0
        if req.top_logprobs_num:
            meta["input_top_logprobs"] = [None if top is None else [[v, t, text(t)] for v, t in top]
                                          for _, _, top in req.input_logprobs]
    return meta


def _entry(rng: random.Random, top: int) -> tuple[float, int, list[tuple[float, int]]]:
    return rng.uniform(-9, 0), rng.randrange(1000), [(rng.uniform(-9, 0), rng.randrange(1000)) for _ in range(top)]


def _req(rng: random.Random, top: int, texts: bool, prompt: bool) -> Req:
    return Req(rid="r", prompt_ids=[rng.randrange(1000) for _ in range(7)], params=SamplingParams(),
               return_logprob=True, top_logprobs_num=top, return_text_in_logprobs=texts,
               logprob_start_len=0 if prompt else -1)


def test_outputs_over_steps_equal_the_naive_form_and_stay_as_sent():
    rng = random.Random(3)
    for top, texts, prompt in [(0, False, False), (3, False, True), (2, True, True), (5, True, False)]:
        req, tok = _req(rng, top, texts, prompt), CountingTokenizer()
        sent: list[tuple[dict, dict]] = []
        for step in range(40):
            if prompt and step < 4:  # chunked prefill: prompt entries arrive over several steps
                if not req.input_logprobs:
                    req.input_logprobs.append((None, req.prompt_ids[0], None))  # nothing before the first
                req.input_logprobs.extend(_entry(rng, top) for _ in range(rng.randrange(1, 5)))
            else:
                req.output_logprobs.append(_entry(rng, top))
            out = output_dict(req, tok)
            want = _naive(req, tok)
            assert {k: v for k, v in out["meta_info"].items() if k in want} == want, (top, texts, prompt, step)
            sent.append((out, _naive(req, tok)))
        # an output handed to the server thread does not grow as the engine appends after it
        for out, want in sent:
            assert {k: v for k, v in out["meta_info"].items() if k in want} == want
        tokens = sum(1 + len(e[2] or ()) for e in req.output_logprobs + req.input_logprobs)
        assert tok.calls == (tokens if texts else 0)  # each token decoded once, not once a step


def test_a_fork_formats_its_own_entries():
    """parallel.fork gives a fork a copy of the prompt entries; its outputs are its own."""
    rng = random.Random(5)
    parent = _req(rng, 2, True, True)
    parent.input_logprobs.extend([(None, 1, None), *(_entry(rng, 2) for _ in range(5))])
    parent.output_logprobs.append(_entry(rng, 2))
    output_dict(parent, CountingTokenizer())
    child = _req(rng, 2, True, True)
    child.input_logprobs = list(parent.input_logprobs)
    child.output_logprobs.append(_entry(rng, 2))
    tok = CountingTokenizer()
    want = _naive(child, tok)
    out = output_dict(child, tok)["meta_info"]
    assert {k: out[k] for k in want} == want


def test_a_replaced_or_shorter_source_list_is_formatted_afresh():
    rng = random.Random(7)
    req = _req(rng, 1, False, False)
    req.output_logprobs.extend(_entry(rng, 1) for _ in range(6))
    output_dict(req)
    req.output_logprobs = [_entry(rng, 1) for _ in range(3)]  # not the list formatted before
    assert output_dict(req)["meta_info"]["output_token_logprobs"] == _naive(req, None)["output_token_logprobs"]
    del req.output_logprobs[1:]  # shorter than what was formatted
    assert output_dict(req)["meta_info"]["output_top_logprobs"] == _naive(req, None)["output_top_logprobs"]
