"""Structured output and logit_bias through a real server (the shared demo-model server) with the official
`openai` client: json_schema outputs always parse and validate (jsonschema), regex outputs fully match,
json_object gives a JSON object, logit_bias forces and bans tokens, bad grammars are a 400 carrying the
compiler's message.

The demo model has random weights: what keeps its outputs finite is the grammar (bounded strings, numbers
and repetitions; the JSON grammar's whitespace between elements is bounded too), so the schemas and
patterns here bound every repetition.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "active"],
    "additionalProperties": False,
}
PATTERN = r"(yes|no), [a-z]{2,6} [0-9]{1,3}\."
MAX_TOKENS = 600  # far above what the bounded grammars need: hitting it would be a failure of the bound


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _in_parallel(fn, n: int) -> list:
    with ThreadPoolExecutor(8) as pool:  # the server batches them
        return list(pool.map(fn, range(n)))


def test_json_schema_outputs_always_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def chat(i: int):
        return client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": f"Describe person number {i}."}], response_format=fmt,
            max_tokens=MAX_TOKENS, temperature=1.0, seed=i)

    for r in _in_parallel(chat, 20):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_schema_through_completions_stream_and_generate(client, http):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    stream = client.completions.create(model="demo", prompt="A number:", max_tokens=MAX_TOKENS, stream=True, seed=3,
                                       extra_body={"response_format": fmt})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)
    r = http.post("/generate", json={"text": "A number:", "sampling_params": {
        "json_schema": json.dumps(schema), "max_new_tokens": MAX_TOKENS, "temperature": 1.0, "sampling_seed": 4}})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["finish_reason"]["type"] == "stop"
    jsonschema.validate(json.loads(r.json()["text"]), schema)


def test_regex_outputs_fully_match(client, http):
    def complete(i: int):
        return client.completions.create(model="demo", prompt=f"Answer {i}:", max_tokens=MAX_TOKENS, temperature=1.0,
                                         seed=i, extra_body={"regex": PATTERN}).choices[0]

    for choice in _in_parallel(complete, 20):
        assert choice.finish_reason == "stop" and re.fullmatch(PATTERN, choice.text), choice
    # SGLang's /generate with sampling_params.regex, and ignore_eos: the grammar's end still ends it
    r = http.post("/generate", json={"text": "Q:", "sampling_params": {
        "regex": PATTERN, "max_new_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 1.0}})
    out = r.json()
    assert out["meta_info"]["finish_reason"]["type"] == "stop" and re.fullmatch(PATTERN, out["text"]), out


def test_inner_anchors_are_served_without_a_stderr_line(server, http):
    """`^yes$|^no$` (anchors xgrammar reads as no-ops, printing a C++ warning line for each): the answer is one of
    the words and the server's output has no line of xgrammar's."""
    def xgrammar_lines() -> int:
        return sum(".cc:" in line and "Warning" in line for line in server.log().splitlines())

    before = xgrammar_lines()
    for seed in range(3):
        r = http.post("/generate", json={"text": "Q:", "sampling_params": {
            "regex": "^yes$|^no$", "max_new_tokens": 8, "temperature": 1.0, "sampling_seed": seed}})
        assert r.status_code == 200 and r.json()["text"] in ("yes", "no"), r.text
    assert xgrammar_lines() == before, server.log()[-2000:]


def test_ebnf_on_generate(http):
    ebnf = 'root ::= "call(" arg ("," arg)? ")"\narg ::= [a-z] [0-9]?'
    for seed in range(5):
        r = http.post("/generate", json={"text": "Go:", "sampling_params": {
            "ebnf": ebnf, "max_new_tokens": MAX_TOKENS, "temperature": 1.0, "sampling_seed": seed}})
        assert r.status_code == 200, r.text
        assert re.fullmatch(r"call\([a-z][0-9]?(,[a-z][0-9]?)?\)", r.json()["text"]), r.json()


def test_json_object_gives_a_json_object(client):
    # the random model wanders inside strings for a long time; a bias towards '"' (4) and '}' (95), which the
    # grammar allows only where they are valid, makes the objects end within the token budget
    def chat(i: int):
        return client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": f"JSON {i}"}], response_format={"type": "json_object"},
            max_tokens=MAX_TOKENS, temperature=1.0, seed=i, logit_bias={"4": 6, "95": 6}).choices[0]

    for choice in _in_parallel(chat, 6):
        assert choice.finish_reason == "stop", choice
        assert isinstance(json.loads(choice.message.content), dict), choice.message.content


def test_logit_bias_forces_a_token(client, http):
    text = http.post("/detokenize", json={"tokens": [77] * 5}).json()["text"]
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       temperature=1.0, logit_bias={"77": 100})
    assert r.choices[0].message.content == text
    g = http.post("/generate", json={"text": "hi", "sampling_params": {
        "max_new_tokens": 5, "temperature": 1.0, "logit_bias": {"77": 100}}}).json()
    assert g["output_ids"] == [77] * 5


def test_logit_bias_bans_a_token(client, http):
    def greedy(bias: dict | None) -> list[int]:
        params = {"max_new_tokens": 4, "temperature": 0.0, "logit_bias": bias}
        return http.post("/generate", json={"text": "The", "sampling_params": params}).json()["output_ids"]

    plain = greedy(None)
    banned = greedy({str(plain[0]): -100})
    assert banned[0] != plain[0] and plain[0] not in banned
    first = client.completions.create(model="demo", prompt="The", max_tokens=1, temperature=0).choices[0].text
    other = client.completions.create(model="demo", prompt="The", max_tokens=1, temperature=0,
                                      logit_bias={str(plain[0]): -100}).choices[0].text
    assert other != first


@pytest.mark.parametrize("extra,words", [
    ({"regex": "a(b"}, ["regex", "parenthesis"]),
    ({"ebnf": "root ::= undefined_rule"}, ["ebnf", "undefined_rule"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     ["json_schema", "type"]),
    ({"json_schema": "{not json"}, ["json_schema", "not valid json"]),
])
def test_bad_grammar_is_a_400_with_the_compilers_message(client, extra, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo", prompt="x", max_tokens=5, extra_body=extra)
    message = info.value.body["message"] if isinstance(info.value.body, dict) else str(info.value)
    assert all(w.lower() in message.lower() for w in words), message


@pytest.mark.parametrize("path,body,words", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "regex": "a",
                              "response_format": {"type": "json_object"}}, ["response_format and regex"]),
    ("/generate", {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, ["regex and ebnf"]),
    ("/generate", {"text": "x", "sampling_params": {"regex": "a" * 200_000}}, ["regex", "--max-grammar-size"]),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"4096": 1}}, ["logit_bias"]),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, ["logit_bias"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema"}}, ["json_schema"]),
])
def test_bad_structured_requests_are_400(http, path, body, words):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    message = r.json()["message"]
    assert all(w.lower() in message.lower() for w in words), message


def test_server_still_serves_after_bad_grammars(http):
    r = http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2


def test_logprobs_with_a_grammar_are_finite(client):
    """Tokens the grammar forbids have probability 0: their logprob is OpenAI's floor -9999, never -inf
    (which is not JSON)."""
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "pick"}], max_tokens=5,
                                       logprobs=True, top_logprobs=5, extra_body={"regex": "(a|b)"})
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content in ("a", "b") and content
    for entry in content:
        assert -9999.0 <= entry.logprob <= 0 and len(entry.top_logprobs) == 5
        assert all(-9999.0 <= t.logprob <= 0 for t in entry.top_logprobs)
    assert any(t.logprob == -9999.0 for t in content[0].top_logprobs)  # fewer than 5 tokens are allowed
