"""A bounded property-based fuzz run over the request models, against a real server on 127.0.0.1.

Hypothesis builds bodies for every POST route from the fields the models know, each field either
well-typed or any JSON value (huge ints, NaN, lone surrogates, nested junk), plus unknown fields.
Fixed seed (derandomize) and a fixed number of cases per route. Properties: no 5xx; every error
is the one error shape; no stream carries an error event; nothing the fuzz sends is aborted (a
request failing inside the engine would end as an abort); no new traceback in the server log;
the server still serves afterwards. Generation lengths are kept tiny so the run stays short.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

BIG = 99999999999999999999
SURROGATES = st.sampled_from(["\ud800", "\udfff", "a\udc80b", "\ud83d"])
WORDS = st.text(max_size=12)  # hypothesis leaves surrogates out of text() by default
WORD = st.text(min_size=1, max_size=12)
TEXT = st.one_of(WORDS, SURROGATES, st.sampled_from(["", " ", "\x00", "🙂", "<|im_start|>", "\n"]))
INTS = st.one_of(st.integers(-3, 5000), st.sampled_from([BIG, -BIG, 2**63, 2**63 - 1, -(2**63) - 1, 2**31, 10**400]))
FLOATS = st.one_of(st.floats(), st.sampled_from([0.0, -0.0, 1e-320, 1e308, 0.5]))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT, st.sampled_from(["no", "true", "1"]))
# any JSON value: what a hostile field holds
BAD = st.recursive(SCALARS, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(TEXT, c, max_size=3)),
                   max_leaves=8)


def mostly(good: st.SearchStrategy, bad: st.SearchStrategy, odds: int = 4) -> st.SearchStrategy:
    """good, but bad once in odds + 1 draws (st.one_of weighs its branches evenly)."""
    return st.sampled_from([True] * odds + [False]).flatmap(lambda ok: good if ok else bad)


# Never absent, null or large when well-formed: the default would be 128 tokens (the whole context in chat).
MAX_TOKENS = mostly(st.integers(0, 3), st.one_of(st.integers(max_value=-1), st.integers(min_value=10**6),
                                                 st.sampled_from([BIG, "3", 2.0, True, [1]])))
IDS = st.lists(st.integers(0, 4095), min_size=1, max_size=5)
UNIMPLEMENTED = ["logit_bias", "response_format", "tools", "tool_choice", "best_of", "json_schema", "regex",
                 "image_data", "lora_path", "suffix", "functions", "return_hidden_states", "logprob_start_len"]


def with_extras(core: st.SearchStrategy) -> st.SearchStrategy:
    """The body plus an unknown or unimplemented field (the core's keys win)."""
    extra = st.dictionaries(st.one_of(TEXT, st.sampled_from(UNIMPLEMENTED)), BAD, min_size=1, max_size=2)
    return st.builds(lambda body, more: {**more, **body}, core, extra)


def mutated(core: st.SearchStrategy, keys: list[str]) -> st.SearchStrategy:
    """Mostly a well-formed body, else one with a field (of keys) set to any JSON value, or an extra field."""
    bad_field = st.builds(lambda body, k, v: {**body, k: v}, core, st.sampled_from(keys), BAD)
    return mostly(core, st.one_of(bad_field, with_extras(core)), odds=3)


def body(required: dict, optional: dict, keep: tuple[str, ...] = ()) -> st.SearchStrategy:
    """Well-formed fields (required and a subset of optional), mutated on any key but those in keep."""
    keys = [k for k in [*required, *optional] if k not in keep]
    return mutated(st.fixed_dictionaries(required, optional=optional), keys)


SAMPLING = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 4096),
    "min_p": st.floats(0, 1), "repetition_penalty": st.floats(0.1, 2), "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2), "stop": st.one_of(st.text(min_size=1, max_size=4),
                                                              st.lists(st.text(min_size=1, max_size=4), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 4095), max_size=3), "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(), "no_stop_trim": st.booleans(),
}
NATIVE_SAMPLING = body({"max_new_tokens": MAX_TOKENS}, dict(
    SAMPLING, spaces_between_special_tokens=st.booleans(), n=st.just(1), sampling_seed=INTS,
    min_new_tokens=st.integers(0, 2)), keep=("max_new_tokens",))
PROMPT = st.one_of(st.fixed_dictionaries({"text": st.one_of(WORD, st.lists(WORD, min_size=1, max_size=3))}),
                   st.fixed_dictionaries({"input_ids": st.one_of(IDS, st.lists(IDS, min_size=1, max_size=2))}))
GENERATE = mutated(st.builds(lambda p, b: {**p, **b}, PROMPT, st.fixed_dictionaries(
    {"sampling_params": NATIVE_SAMPLING}, optional={"stream": st.booleans(), "return_logprob": st.booleans(),
                                                   "top_logprobs_num": st.integers(0, 25), "rid": WORDS})),
    ["text", "input_ids", "stream", "return_logprob", "top_logprobs_num", "rid"])
OPENAI = dict(SAMPLING, model=st.just("demo"), n=st.just(1), stream=st.booleans(),
              stream_options=st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}), seed=INTS,
              user=WORDS, min_tokens=st.integers(0, 2), rid=WORDS)
COMPLETIONS = body({"max_tokens": MAX_TOKENS, "prompt": st.one_of(WORD, st.lists(WORD, min_size=1, max_size=3), IDS,
                                                                  st.lists(IDS, min_size=1, max_size=2))},
                   dict(OPENAI, echo=st.booleans(), logprobs=st.integers(0, 25)), keep=("max_tokens",))
PART = body({"type": st.just("text"), "text": WORDS}, {})
MESSAGE = body({"role": st.sampled_from(["system", "user", "assistant"]),
                "content": st.one_of(WORDS, st.lists(PART, max_size=2))}, {"name": WORDS})
TEMPLATE_KEYS = st.sampled_from(["tokenize", "return_dict", "add_generation_prompt", "enable_thinking", "messages",
                                 "tools", "chat_template", "continue_final_message", "documents"])
CHAT = body({"max_tokens": MAX_TOKENS, "messages": st.lists(MESSAGE, min_size=1, max_size=3)},
            dict(OPENAI, max_completion_tokens=st.integers(0, 3), logprobs=st.booleans(),
                 top_logprobs=st.integers(0, 25), continue_final_message=st.booleans(),
                 chat_template_kwargs=st.dictionaries(st.one_of(WORDS, TEMPLATE_KEYS), BAD, max_size=2)),
            keep=("max_tokens", "max_completion_tokens"))
TOKENIZE = body({"prompt": st.one_of(WORDS, st.lists(WORDS, max_size=3))},
                {"add_special_tokens": st.booleans(), "model": st.just("demo")})
DETOKENIZE = body({"tokens": st.one_of(IDS, st.lists(IDS, max_size=2))}, {"skip_special_tokens": st.booleans()})
ABORT = body({}, {"rid": WORDS, "abort_all": st.booleans()})
TEXT_PART = body({"type": st.sampled_from(["input_text", "output_text"]), "text": WORDS}, {})
ITEM = st.one_of(
    body({"role": st.sampled_from(["system", "developer", "user", "assistant"]),
          "content": st.one_of(WORDS, st.lists(TEXT_PART, max_size=2))}, {"type": st.just("message")}),
    body({"type": st.just("function_call"), "call_id": WORD, "name": WORD, "arguments": st.just("{}")}, {}),
    body({"type": st.just("function_call_output"), "call_id": WORD, "output": WORDS}, {}))
FUNCTION_TOOL = body({"type": st.just("function"), "name": st.sampled_from(["get_weather", "f"])},
                     {"parameters": st.just({"type": "object", "properties": {}}), "description": WORDS})
RESPONSES = body({"max_output_tokens": MAX_TOKENS, "input": st.one_of(WORD, st.lists(ITEM, min_size=1, max_size=3))},
                 {"model": st.just("demo"), "instructions": WORDS, "temperature": st.floats(0, 2),
                  "top_p": st.floats(0.01, 1), "stream": st.booleans(), "store": st.booleans(), "user": WORDS,
                  "metadata": st.dictionaries(WORD, WORDS, max_size=2), "tools": st.lists(FUNCTION_TOOL, max_size=2),
                  "tool_choice": st.sampled_from(["auto", "none"]), "parallel_tool_calls": st.booleans(),
                  "text": st.just({"format": {"type": "text"}}), "reasoning": st.just({"effort": "low"})},
                 keep=("max_output_tokens",))

# (path, strategy, cases): ~50 s on a 2-core machine shared with other work
ROUTES = [("/generate", GENERATE, 250), ("/v1/completions", COMPLETIONS, 180), ("/v1/chat/completions", CHAT, 180),
          ("/v1/responses", RESPONSES, 120), ("/tokenize", TOKENIZE, 80), ("/detokenize", DETOKENIZE, 80), ("/abort_request", ABORT, 40)]


def _check(path: str, body: object, r: httpx.Response) -> str:
    """Assert the properties of one answer; its outcome class for the tally."""
    assert r.status_code < 500, (path, body, r.status_code, r.text)
    if r.status_code >= 400:
        err = r.json()
        assert err["error"]["code"] == r.status_code and err["message"] == err["error"]["message"], (body, r.text)
        return str(r.status_code)
    if path == "/v1/responses":  # OpenAI's named events, no [DONE]; the last one ends the response
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
            assert events and not any(e["type"] in ("error", "response.failed") for e in events), (body, r.text)
            final = events[-1]["response"]
            assert events[-1]["type"] in ("response.completed", "response.incomplete"), (body, r.text)
        else:
            final = r.json()
        assert final["status"] in ("completed", "incomplete"), (body, final)  # cancelled: an abort inside
        return "200"
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", (body, r.text)
        outs = [json.loads(e) for e in events[:-1]]
        assert not any("error" in o for o in outs), (body, r.text)
    elif path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        data = r.json()
        outs = data if isinstance(data, list) else [data]
    else:
        return "200"
    for o in outs:
        reason = (o.get("meta_info") or {}).get("finish_reason") or {}
        choices = o.get("choices") or []
        assert reason.get("type") != "abort" and all(c.get("finish_reason") != "abort" for c in choices), (body, o)
    return "200"


def _fuzz(http: httpx.Client, path: str, strategy: st.SearchStrategy, cases: int, tally: Counter[str]) -> None:
    """Post `cases` bodies drawn from strategy (fixed seed) to path, checking each answer."""

    @settings(max_examples=cases, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(body=strategy)
    def run(body: object) -> None:
        # json.dumps (ensure_ascii): lone surrogates travel as \ud800 escapes, NaN/inf as Python's literals
        r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        tally[f"{path} {_check(path, body, r)}"] += 1

    run()


def test_fuzz_request_models(server, record_property):
    tally: Counter[str] = Counter()
    errors_before = len(server.error_lines())
    t0 = time.time()
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for path, strategy, cases in ROUTES:
            _fuzz(http, path, strategy, cases, tally)
        health = http.get("/health")
        after = http.post("/generate", json={"text": "The", "sampling_params": {"max_new_tokens": 3,
                                                                                 "ignore_eos": True}})
    elapsed = time.time() - t0
    total = sum(tally.values())
    summary = f"fuzz: {total} cases in {elapsed:.0f} s, " + ", ".join(f"{k}: {v}" for k, v in sorted(tally.items()))
    print(summary)
    record_property("fuzz_summary", summary)
    assert total >= sum(c for _, _, c in ROUTES), summary  # every case ran (shrinking adds more only on failure)
    served = sum(v for k, v in tally.items() if k.endswith(" 200"))
    assert served >= total // 5, summary  # well-formed bodies reach the engine too, not only the validators
    assert health.status_code == 200 and after.status_code == 200, after.text
    assert after.json()["meta_info"]["completion_tokens"] == 3
    assert server.error_lines()[errors_before:] == [], "\n".join(server.error_lines()[errors_before:])
