"""A streamed /generate request's events (server/streaming.CumulativeEvents) are sse()'s bytes, with each
logprob entry encoded once over the request's life.

SGLang's stream repeats every entry so far in each event. Encoding the whole output again for each event took
73 ms an event at 8000 tokens with 5 top logprobs (2-core Zen 4), on the event loop."""

from __future__ import annotations

import random

from hybridmoe.engine.outputs import output_dict
from hybridmoe.server import streaming
from hybridmoe.server.streaming import CumulativeEvents, sse
from tests.test_output_cache import _entry, _req  # a request's logprob entries, random


class Tokenizer:
    """Token texts with the characters an event must escape (line splitters, quotes, non-ASCII)."""

    def decode(self, ids: list[int]) -> str:
        return ["a", "\u2028", "\"q\"", "\x85x", "é\n", "\u2029", "\\"][ids[0] % 7]


def test_events_over_a_request_equal_sse_of_each_output():
    rng = random.Random(11)
    for top, texts, prompt, index in [(0, False, False, None), (3, True, True, 2), (5, True, False, None),
                                      (1, False, True, 0)]:
        req, events = _req(rng, top, texts, prompt), CumulativeEvents()
        for step in range(60):
            if prompt and step < 5:  # chunked prefill: prompt entries arrive over several steps
                if not req.input_logprobs:
                    req.input_logprobs.append((None, req.prompt_ids[0], None))
                req.input_logprobs.extend(_entry(rng, top) for _ in range(rng.randrange(1, 4)))
            else:
                for _ in range(rng.randrange(0, 3)):  # the stream skips outputs; 0: the same entries again
                    req.output_logprobs.append(_entry(rng, top))
            req.text = "".join(rng.choice(["x", "\u2028", "\"", "\x85", "ü"]) for _ in range(step))
            if step == 30:
                req.finish_reason = {"type": "length", "length": 60}
            out = output_dict(req, Tokenizer())
            data = dict(out, text=out["text"][:-1]) if index is None else dict(out, text=out["text"], index=index)
            got = events.event(data)
            assert got == sse(data), (top, texts, prompt, step)
            assert not any(c in got.decode()[:-2] for c in "\n\x85\u2028\u2029")  # one line for every splitter


def _same(events: CumulativeEvents, data: dict) -> None:
    assert events.event(data) == sse(data)


def test_a_list_not_grown_from_the_one_before_is_encoded_anew():
    rng = random.Random(13)
    req, events = _req(rng, 2, False, False), CumulativeEvents()
    req.output_logprobs.extend(_entry(rng, 2) for _ in range(6))
    _same(events, output_dict(req))
    req.output_logprobs = [_entry(rng, 2) for _ in range(8)]  # longer, but other entries
    _same(events, output_dict(req))
    del req.output_logprobs[2:]  # shorter
    _same(events, output_dict(req))
    # lists built by hand: the same length, the last entry another object
    data = {"text": "", "meta_info": {"output_token_logprobs": [[-1.0, 1, None], [-2.0, 2, None]]}}
    assert events.event(data) == sse(data)
    data["meta_info"]["output_token_logprobs"] = [data["meta_info"]["output_token_logprobs"][0], [-3.0, 3, None]]
    assert events.event(data) == sse(data)
    data["meta_info"]["output_token_logprobs"] = []
    assert events.event(data) == sse(data)
    assert events.event({"text": "no meta"}) == sse({"text": "no meta"})


def test_each_entry_is_encoded_once(monkeypatch):
    """Over 400 outputs of one request, the entries encoded are the entries, plus a bounded count per event
    (its other fields); before, every event encoded every entry so far (~80,000 here)."""
    calls = 0
    real = streaming._dumps

    def counting(value):
        nonlocal calls
        calls += 1
        return real(value)

    monkeypatch.setattr(streaming, "_dumps", counting)
    rng = random.Random(17)
    req, events = _req(rng, 4, False, True), CumulativeEvents()
    req.input_logprobs.extend([(None, 1, None), *(_entry(rng, 4) for _ in range(20))])
    for _ in range(400):
        req.output_logprobs.append(_entry(rng, 4))
        events.event(output_dict(req))
    fields = 3 + 2 * 11  # the output's keys, meta_info's keys and values but the logprob lists
    assert calls <= 2 * 400 + 2 * 21 + 400 * fields, calls
