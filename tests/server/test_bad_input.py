"""Bad requests get a 4xx JSON error naming the problem, and the server keeps serving."""

from __future__ import annotations

import pytest

LONG = "word " * 3000  # beyond the demo model's 2048-token context
OK_GENERATE = {"text": "Return the", "sampling_params": {"max_new_tokens": 2}}

CASES = [
    # (name, path, body (bytes = raw), expected status, a word the message must contain)
    ("malformed json", "/generate", b'{"text": "a", ', 400, "JSON"),
    ("not an object", "/generate", b"[1, 2]", 400, "body"),
    ("body not utf-8", "/generate", b'{"text": "\xff\xfe"}', 400, "UTF-8"),
    ("json nested 100000 deep", "/generate", b"[" * 100000 + b"]" * 100000, 400, "nested too deeply"),
    ("integer of 5000 digits", "/generate", b'{"text": "a", "sampling_params": {"max_new_tokens": 1' + b"0" * 5000 + b"}}",
     400, "digits"),
    ("wrong type text", "/generate", {"text": 5}, 400, "text"),
    ("wrong type params", "/generate", {"text": "a", "sampling_params": {"max_new_tokens": "many"}}, 400,
     "max_new_tokens"),
    ("unknown sampling param", "/generate", {"text": "a", "sampling_params": {"temprature": 1}}, 400, "temprature"),
    ("text and ids", "/generate", {"text": "a", "input_ids": [1]}, 400, "exactly one"),
    ("no prompt", "/generate", {"sampling_params": {}}, 400, "exactly one"),
    ("empty prompt", "/generate", {"text": ""}, 400, "empty"),
    ("empty ids", "/generate", {"input_ids": []}, 400, "empty"),
    ("id out of vocab", "/generate", {"input_ids": [10**9]}, 400, "input_ids"),
    ("prompt too long", "/generate", {"text": LONG}, 400, "context length"),
    ("negative max_new_tokens", "/generate", {"text": "a", "sampling_params": {"max_new_tokens": -1}}, 400,
     "max_new_tokens"),
    ("oversize max_new_tokens", "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 10**7}}, 400,
     "context length"),
    ("negative temperature", "/generate", {"text": "a", "sampling_params": {"temperature": -0.5}}, 400,
     "temperature"),
    ("top_p zero", "/generate", {"text": "a", "sampling_params": {"top_p": 0}}, 400, "top_p"),
    ("stop list of ints", "/generate", {"text": "a", "sampling_params": {"stop": [1, 2]}}, 400, "stop"),
    ("stop with empty string", "/generate", {"text": "a", "sampling_params": {"stop": ["ok", ""]}}, 400, "stop"),
    ("stream batch", "/generate", {"text": ["a", "b"], "stream": True}, 400, "stream"),
    ("openai unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "a"}, 404, "gpt-9"),
    ("openai empty prompt", "/v1/completions", {"model": "demo", "prompt": ""}, 400, "empty"),
    ("openai n above --max-n-samples", "/v1/completions", {"model": "demo", "prompt": "a", "n": 65}, 400, "n"),
    ("openai max_tokens negative", "/v1/completions", {"model": "demo", "prompt": "a", "max_tokens": -3}, 400,
     "max_tokens"),
    ("openai max_tokens oversize", "/v1/completions", {"model": "demo", "prompt": "a", "max_tokens": 10**6}, 400,
     "context length"),
    ("openai top_p zero", "/v1/completions", {"model": "demo", "prompt": "a", "top_p": 0}, 400, "top_p"),
    ("openai bad stop", "/v1/completions", {"model": "demo", "prompt": "a", "stop": [None]}, 400, "stop"),
    ("openai prompt too long", "/v1/completions", {"model": "demo", "prompt": LONG}, 400, "context length"),
    ("chat no messages", "/v1/chat/completions", {"model": "demo", "messages": []}, 400, "messages"),
    ("chat bad role", "/v1/chat/completions", {"model": "demo", "messages": [{"role": "wizard", "content": "x"}]},
     400, "role"),
    ("chat negative temperature", "/v1/chat/completions",
     {"model": "demo", "messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400, "temperature"),
    ("chat unknown model", "/v1/chat/completions",
     {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "nope"),
    ("detokenize out of vocab", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("tokenize wrong type", "/tokenize", {"prompt": 3}, 400, "prompt"),
    ("batch past --max-sequences-per-request", "/generate", {"text": ["a"] * 4097, "sampling_params": {"max_new_tokens": 1}},
     400, "--max-sequences-per-request"),
    ("batch times n past the limit", "/generate",
     {"input_ids": [[1]] * 65, "sampling_params": {"max_new_tokens": 1, "n": 64}}, 400, "4160 sequences"),
    ("per-prompt n past the limit", "/generate",
     {"text": ["a", "b"] * 80, "sampling_params": [{"n": 64}, {"n": 1}] * 80}, 400, "5200 sequences"),
    ("openai prompts past the limit", "/v1/completions", {"model": "demo", "prompt": ["a"] * 4097}, 400,
     "--max-sequences-per-request"),
    ("openai prompts times n past the limit", "/v1/completions", {"model": "demo", "prompt": [[1]] * 100, "n": 41},
     400, "4100 sequences"),
]


@pytest.mark.parametrize("name,path,body,status,word", CASES, ids=[c[0] for c in CASES])
def test_bad_request_is_a_json_4xx_and_harmless(http, name, path, body, status, word):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()
    assert word.lower() in err["error"]["message"].lower() and err["message"] == err["error"]["message"]
    assert err["error"]["code"] == status
    ok = http.post("/generate", json=OK_GENERATE)
    assert ok.status_code == 200 and ok.json()["meta_info"]["finish_reason"] is not None


def test_unknown_route_is_404(http):
    assert http.get("/no/such/route").status_code == 404


def test_unsupported_features_are_refused(http):
    r = http.post("/generate", json={"text": "a", "lora_path": "my-adapter"})
    assert r.status_code == 400 and "LoRA" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": "demo", "prompt": "a", "suffix": "b"})
    assert r.status_code == 400 and "suffix" in r.json()["error"]["message"]


@pytest.mark.parametrize("char", ["\x85", "\u2028", "\u2029"])
def test_stream_events_survive_unicode_line_separators(http, char):
    """Echoed text holding a character that str.splitlines (and so a client reading the stream with it)
    takes for a line end: every event stays one line, its JSON the same text. Found by a randomized run of
    test_fuzz's strategies (prompt "\\x85", echo, stream: the event was cut in two)."""
    import json

    from hybridmoe.server.streaming import sse

    event = sse({"text": f"a{char}b"})
    assert event.endswith(b"\n\n") and len(event[:-2].decode().splitlines()) == 1
    assert json.loads(event[6:]) == {"text": f"a{char}b"}
    r = http.post("/v1/completions", json={"model": "demo", "prompt": f"x{char}y", "max_tokens": 1, "echo": True,
                                           "stream": True, "temperature": 0})
    assert r.status_code == 200, r.text
    lines = [ln for ln in r.text.splitlines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines), lines
    texts = "".join(c["text"] for ln in lines[:-1] for c in json.loads(ln[6:])["choices"])
    assert texts.startswith(f"x{char}y")
