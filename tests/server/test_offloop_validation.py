"""A large JSON body is validated against its route's model in a thread (app.OffLoopJSONRoute): pydantic took
~1.2-1.6 s on the event loop for a 6.5 MiB chat body of 200,000 messages, every stream stopped meanwhile. The
answers are those of FastAPI's own validation: the same errors, the same 400 shape."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from hybridmoe.config import EngineArgs
from hybridmoe.engine.engine import Engine
from hybridmoe.server import app as app_module
from hybridmoe.server.limits import ServerLimits
from tests.server.conftest import DEMO
from tests.server.inproc import serve_in_thread

N = 20_000  # messages: a body over OFF_LOOP_VALIDATE_BYTES


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    if not (DEMO / "config.json").is_file():
        pytest.skip("the demo model is not built")
    engine = Engine(EngineArgs(model_path=str(DEMO), device="cpu"), progress=False)
    with serve_in_thread(lambda args: engine, limits=ServerLimits(tokenizer_workers=1)) as base:
        yield base


@pytest.fixture()
def threads(monkeypatch) -> list[str]:
    """Where each _validated call ran: "loop" (a thread running an event loop) or "worker"."""
    seen: list[str] = []
    real = app_module._validated

    def spy(model, data):
        try:
            asyncio.get_running_loop()
            seen.append("loop")
        except RuntimeError:
            seen.append("worker")
        return real(model, data)

    monkeypatch.setattr(app_module, "_validated", spy)
    return seen


def _post(url: str, path: str, body: object) -> httpx.Response:
    raw = json.dumps(body).encode()
    return httpx.post(url + path, content=raw, headers={"content-type": "application/json"}, timeout=120)


def test_a_large_valid_body_is_validated_off_the_loop(url, threads):
    messages = [{"role": "user", "content": "a"}] * (N - 1) + [{"role": "user", "content": "hi"}]
    body = {"messages": messages, "max_tokens": 1}
    assert len(json.dumps(body)) >= app_module.OFF_LOOP_VALIDATE_BYTES
    r = _post(url, "/v1/chat/completions", body)
    # valid, so it reaches the route: the prompt is longer than the demo model's context
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert threads == ["worker"], threads


def test_a_large_invalid_body_gives_fastapis_error_off_the_loop(url, threads):
    messages = [{"role": "user", "content": "a"}] * (N - 1) + [{"role": "robot", "content": "a"}]
    big = _post(url, "/v1/chat/completions", {"messages": messages})
    small = _post(url, "/v1/chat/completions", {"messages": [{"role": "robot", "content": "a"}]})
    assert threads == ["worker"]  # only the large one, in a worker thread
    assert big.status_code == small.status_code == 400, (big.text, small.text)
    b, s = big.json()["error"], small.json()["error"]
    assert b["param"] == s["param"].replace("messages.0", f"messages.{N - 1}"), (b, s)
    assert b["message"] == s["message"].replace("messages.0", f"messages.{N - 1}"), (b, s)


def test_a_large_body_that_is_not_json_is_reported_as_before(url, threads):
    raw = b'{"messages": [' + b'{"role": "user", "content": "a"},' * N + b"oops"
    r = httpx.post(url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text
    assert threads == []


def test_a_long_chat_is_made_template_messages_off_the_loop(url, monkeypatch):
    from hybridmoe.server import openai_api

    seen: list[str] = []
    real = openai_api._template_messages

    def spy(body):
        try:
            asyncio.get_running_loop()
            seen.append("loop")
        except RuntimeError:
            seen.append("worker")
        return real(body)

    monkeypatch.setattr(openai_api, "_template_messages", spy)
    short = [{"role": "user", "content": "hi"}]
    assert _post(url, "/v1/chat/completions", {"messages": short, "max_tokens": 1}).status_code == 200
    long = [{"role": "user", "content": "a"}] * (openai_api.OFF_LOOP_MESSAGES + 1)
    r = _post(url, "/v1/chat/completions", {"messages": long, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text  # longer than the context
    assert seen == ["loop", "worker"], seen
