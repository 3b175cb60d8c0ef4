"""The HTTP API against a real server: OpenAI client, raw /generate, the SDK, auxiliary routes."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from hybridmoe.client import AsyncClient, Client, ServerError

PROMPT = "The default value"
CHAT = [{"role": "user", "content": "What does json.dumps do?"}]


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def sdk(server):
    with Client(port=server.port, host="127.0.0.1") as c:
        yield c


def _sse(lines) -> list:
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_models(oai):
    assert [m.id for m in oai.models.list().data] == ["demo"]


def test_openai_completion(oai):
    r = oai.completions.create(model="demo", prompt=PROMPT, max_tokens=8, temperature=0)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length") and c.text
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
    chunks = list(oai.completions.create(model="demo", prompt=PROMPT, max_tokens=8, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    assert chunks[-1].choices[0].finish_reason == c.finish_reason


def test_openai_chat(oai):
    r = oai.chat.completions.create(model="demo", messages=CHAT, max_tokens=12, temperature=0)
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stream = oai.chat.completions.create(model="demo", messages=CHAT, max_completion_tokens=12, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == msg.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_openai_stop_and_logprobs(oai):
    full = oai.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    assert len(full.choices[0].logprobs.token_logprobs) == 12
    words = full.choices[0].text.split()
    stop = words[2]
    cut = oai.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                 extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop" and full.choices[0].text.startswith(cut.choices[0].text)
    assert stop not in cut.choices[0].text
    streamed = oai.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                      stream=True, extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in streamed) == cut.choices[0].text


def test_generate_raw(http):
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    out = http.post("/generate", json=body).json()
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6} and meta["completion_tokens"] == 6
    assert len(out["output_ids"]) == 6 and meta["prompt_tokens"] > 0 and meta["e2e_latency"] > 0
    with http.stream("POST", "/generate", json=dict(body, stream=True)) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r.iter_lines())
    assert events[-1]["text"] == out["text"] and events[-1]["output_ids"] == out["output_ids"]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(events, events[1:]))  # cumulative
    batch = http.post("/generate", json={"input_ids": [out["output_ids"][:3], [5, 6, 7]],
                                         "sampling_params": {"max_new_tokens": 2}}).json()
    assert [len(b["output_ids"]) for b in batch] == [2, 2] or all(b["meta_info"]["finish_reason"] for b in batch)


def test_sdk(sdk, server):
    out = sdk.generate(prompt=PROMPT, max_new_tokens=6, temperature=0, ignore_eos=True)
    assert out.output_text and len(out.output_ids) == 6 and out.finish_reason["type"] == "length"
    chunks = list(sdk.generate(prompt=PROMPT, max_new_tokens=6, temperature=0, ignore_eos=True, stream=True))
    assert "".join(c.delta for c in chunks) == out.output_text and chunks[-1].finish_reason == out.finish_reason
    chat = sdk.chat(CHAT, max_tokens=8, temperature=0)
    assert chat.output_text and chat.finish_reason in ("stop", "length")
    assert sdk.health() and sdk.model_info()["is_generation"]
    assert sdk.detokenize(sdk.tokenize("hello world")) == "hello world"
    with pytest.raises(ServerError, match="top_p"):
        sdk.generate(prompt=PROMPT, top_p=0)

    async def run() -> str:
        async with AsyncClient(host="127.0.0.1", port=server.port) as ac:
            res = await ac.generate(prompt=PROMPT, max_new_tokens=6, temperature=0, ignore_eos=True)
            text = ""
            async for c in await ac.generate(prompt=PROMPT, max_new_tokens=6, temperature=0, ignore_eos=True,
                                             stream=True):
                text += c.delta
            assert text == res.output_text
            return res.output_text

    assert asyncio.run(run()) == out.output_text


def test_aux_routes(http):
    assert http.get("/health_generate").status_code == 200
    info = http.get("/get_server_info").json()
    assert info["served_model_name"] == "demo" and "kv_used_pages" in info and info["api_key"] is None
    model = http.get("/get_model_info").json()
    assert model["context_length"] > 0 and model["model_type"] == "qwen3_moe"
    metrics = http.get("/metrics").text
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:gen_throughput",
                 "sglang:time_to_first_token_seconds_bucket", "sglang:inter_token_latency_seconds_bucket",
                 "sglang:e2e_request_latency_seconds_count", "sglang:prompt_tokens_total",
                 "sglang:generation_tokens_total"):
        assert name in metrics, name
    r = http.post("/flush_cache")
    assert r.status_code == 200, r.text
    assert http.post("/abort_request", json={"rid": "no-such-request"}).status_code == 200


def test_abort_request_by_rid(http, server):
    body = {"text": PROMPT, "rid": "to-abort", "stream": True,
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        assert http.post("/abort_request", json={"rid": "to-abort"}).status_code == 200
        events = _sse(lines)
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert events[-1]["meta_info"]["completion_tokens"] < 1000


def test_generate_without_json_content_type(server):
    """`curl -d '{...}'` sends form encoding; the body is still read as JSON, as SGLang does."""
    body = json.dumps({"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    r = httpx.post(server.url + "/generate", content=body,
                   headers={"content-type": "application/x-www-form-urlencoded"}, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] >= 1
    bad = httpx.post(server.url + "/generate", content="text=hello",
                     headers={"content-type": "application/x-www-form-urlencoded"}, timeout=60)
    assert bad.status_code == 400 and "JSON" in bad.json()["message"]
