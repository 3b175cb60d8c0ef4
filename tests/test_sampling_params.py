"""SamplingParams.validate is strict: the offline LLM API goes through it, and nothing out of range
may reach torch (a huge int once overflowed a tensor and failed every request in the batch)."""

from __future__ import annotations

import math
import random

import pytest

from hybridmoe.engine.request import (
    INT64_MAX,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    SamplingParamsError,
)

BIG = 99999999999999999999
VOCAB = 4096

BAD = [
    {"top_k": BIG}, {"top_k": VOCAB + 1}, {"top_k": 0}, {"top_k": -2}, {"top_k": 2.0}, {"top_k": True},
    {"temperature": BIG}, {"temperature": math.inf}, {"temperature": math.nan}, {"temperature": -1e-9},
    {"temperature": "0.5"}, {"temperature": True}, {"temperature": 10**400},
    {"repetition_penalty": BIG}, {"repetition_penalty": 0}, {"repetition_penalty": 2.5}, {"repetition_penalty": math.nan},
    {"frequency_penalty": 2.01}, {"frequency_penalty": -math.inf}, {"presence_penalty": -BIG},
    {"top_p": 0}, {"top_p": 1.0001}, {"top_p": math.nan}, {"min_p": -0.1}, {"min_p": math.inf},
    {"max_new_tokens": BIG}, {"max_new_tokens": -1}, {"max_new_tokens": 3.0}, {"max_new_tokens": False},
    {"min_new_tokens": BIG}, {"min_new_tokens": 5, "max_new_tokens": 4}, {"min_new_tokens": "1"},
    {"ignore_eos": "no"}, {"ignore_eos": 1}, {"skip_special_tokens": "no"}, {"skip_special_tokens": None},
    {"spaces_between_special_tokens": "yes"}, {"no_stop_trim": 0},
    {"stop": ""}, {"stop": [""]}, {"stop": ["ok", 1]}, {"stop": "\ud800"}, {"stop": ["a\udfffb"]},
    {"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, {"stop": "x" * (MAX_STOP_CHARS + 1)}, {"stop": 5},
    {"stop_token_ids": [BIG]}, {"stop_token_ids": [VOCAB]}, {"stop_token_ids": [-1]}, {"stop_token_ids": [True]},
    {"stop_token_ids": [1.0]}, {"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, {"stop_token_ids": 3},
    {"n": 0}, {"n": 1025}, {"n": True}, {"n": 1.0}, {"sampling_seed": BIG}, {"sampling_seed": -BIG}, {"sampling_seed": 1.5},
    {"sampling_seed": "7"},
]


@pytest.mark.parametrize("bad", BAD, ids=[repr(b)[:60] for b in BAD])
def test_invalid_values_name_their_field(bad):
    params = SamplingParams.from_any(bad)
    with pytest.raises(SamplingParamsError) as e:
        params.validate(VOCAB)
    # the message names the bad field (min_new_tokens > max_new_tokens names min_new_tokens)
    assert str(e.value).startswith(next(iter(bad)) + "=")
    assert len(str(e.value)) < 400  # a huge value is shortened, not echoed whole


def _random_valid(rng: random.Random) -> dict:
    max_new = rng.randrange(0, 2048)
    return {
        "max_new_tokens": max_new, "min_new_tokens": rng.randrange(0, max_new + 1),
        "temperature": rng.choice([0, 0.0, rng.uniform(0, 100), 100]), "top_p": rng.choice([1, rng.uniform(1e-6, 1)]),
        "top_k": rng.choice([-1, 1, VOCAB, rng.randrange(1, VOCAB + 1)]), "min_p": rng.uniform(0, 1),
        "repetition_penalty": rng.choice([2, rng.uniform(1e-6, 2)]), "frequency_penalty": rng.uniform(-2, 2),
        "presence_penalty": rng.choice([-2, 2, rng.uniform(-2, 2)]),
        "stop": rng.choice([None, "é" * rng.randrange(1, MAX_STOP_CHARS + 1), ["a"] * MAX_STOP_STRINGS]),
        "stop_token_ids": rng.choice([None, [], [VOCAB - 1] * MAX_STOP_TOKEN_IDS]),
        "ignore_eos": rng.random() < 0.5, "skip_special_tokens": rng.random() < 0.5, "n": 1,
        "sampling_seed": rng.choice([None, -(2**63), 2**63 - 1, rng.randrange(-(2**63), 2**63)]),
    }


def test_valid_values_at_the_bounds_pass():
    rng = random.Random()
    for _ in range(300):
        values = _random_valid(rng)
        SamplingParams.from_any(values).validate(VOCAB)
        SamplingParams.from_any(values).validate(VOCAB, context_len=2048)


def test_vocab_and_context_bounds_apply_only_when_known():
    SamplingParams(top_k=10**6, stop_token_ids=[10**6]).validate()  # no vocabulary known: only int64
    with pytest.raises(SamplingParamsError, match="top_k"):
        SamplingParams(top_k=10**6).validate(VOCAB)
    with pytest.raises(SamplingParamsError, match="top_k"):
        SamplingParams(top_k=INT64_MAX + 1).validate()
    SamplingParams(max_new_tokens=4096).validate(VOCAB)
    with pytest.raises(SamplingParamsError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=4096).validate(VOCAB, context_len=2048)


def test_offline_llm_refuses_an_overflow_and_keeps_serving(tiny_model_dir):
    """The offline API: an overflow is a RequestError naming the field, before any tensor exists, and
    the engine serves the next request."""
    from hybridmoe import LLM
    from hybridmoe.engine.engine import RequestError

    llm = LLM(str(tiny_model_dir("qwen3_moe")), device="cpu", progress=False)
    prompt = [random.randrange(200) for _ in range(5)]
    for bad in ({"top_k": BIG}, {"temperature": BIG}, {"repetition_penalty": BIG}, {"skip_special_tokens": "no"}):
        with pytest.raises(RequestError, match=next(iter(bad))):
            llm.generate(input_ids=prompt, sampling_params=dict(bad, max_new_tokens=2))
    out = llm.generate(input_ids=prompt, sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    assert len(out["output_ids"]) == 3 and out["meta_info"]["finish_reason"]["type"] == "length"
