"""SGLang's `lora_path` on the OpenAI routes (/v1/completions, /v1/chat/completions): it means what /generate's
does (a loaded adapter's name; on /v1/completions a list of one per prompt), agrees with the `model:
"<served>:<adapter>"` form (the same greedy answer, not the base model's), and is refused as /generate refuses it
(an unknown adapter, LoRA off: the same 400 naming `lora_path`); a `model` suffix that names another adapter is a
400 naming both. /v1/responses has no such field (SGLang's ResponsesRequest has none): unknown there.

In-process servers (tests/server/inproc.py) on the demo model, which has a chat template; the adapters are
lora_fixtures' hand-made ones (attention, experts)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from lora_fixtures import hand_adapter

from hybridmoe.config import EngineArgs
from hybridmoe.engine.engine import Engine
from tests.server.inproc import serve_in_thread

DEMO = Path(__file__).resolve().parents[2] / "hybridmoe" / "demo_model"
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
CHAT = [{"role": "user", "content": "Tell me about the sea."}]
PROMPTS = ["Once upon a time", "The capital of", "1, 2, 3,"]


@pytest.fixture(scope="module")
def lora_url(tmp_path_factory):
    """A server of the demo model with the adapters "one" and "two" (served as "demo")."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(DEMO))
    d = tmp_path_factory.mktemp("openai_adapters")
    one = hand_adapter(cfg, d / "one", seed=1)
    two = hand_adapter(cfg, d / "two", seed=2, with_experts=False)
    args = EngineArgs(model_path=str(DEMO), device="cpu", dtype="float32", lora_paths=[f"one={one}", f"two={two}"])
    engine = Engine(args, progress=False)
    with serve_in_thread(lambda _: engine, model_path=str(DEMO), served_model_name="demo") as url:
        yield url


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def _error(r: httpx.Response, param: str) -> str:
    """The message of a 400 naming param."""
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, r.text
    return err["message"]


def _completion(url: str, **fields) -> list[str]:
    body = dict(GREEDY, model="demo", prompt=PROMPTS[0]) | fields
    return [c["text"] for c in _ok(_post(url, "/v1/completions", body))["choices"]]


def _chat(url: str, **fields) -> str:
    body = dict(GREEDY, model="demo", messages=CHAT) | fields
    return _ok(_post(url, "/v1/chat/completions", body))["choices"][0]["message"]["content"]


def _streamed_chat(url: str, **fields) -> str:
    body = dict(GREEDY, model="demo", messages=CHAT, stream=True) | fields
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_lora_path_is_the_model_suffix(lora_url, route):
    """lora_path="one" answers as model "demo:one" (and as both, agreeing), not as the base model."""
    ask = _completion if route == "completions" else _chat
    base = ask(lora_url)
    suffix = ask(lora_url, model="demo:one")
    assert suffix != base, "the adapter must change the answer for the test to mean anything"
    assert ask(lora_url, lora_path="one") == suffix
    assert ask(lora_url, model="demo:one", lora_path="one") == suffix  # both given, agreeing
    assert ask(lora_url, model="one", lora_path="one") == suffix
    assert ask(lora_url, lora_path=None) == base  # null: the field left out
    assert ask(lora_url, lora_path="two") not in (base, suffix)
    if route == "chat":
        assert _streamed_chat(lora_url, lora_path="one") == suffix


def test_completions_lora_path_list_is_one_per_prompt(lora_url):
    alone = {name: _completion(lora_url, prompt=p, lora_path=name)[0]
             for p, name in zip(PROMPTS, [None, "one", "two"])}
    got = _completion(lora_url, prompt=PROMPTS, lora_path=[None, "one", "two"])
    assert got == list(alone.values())
    # n > 1: each prompt's sequences run its adapter
    got = _completion(lora_url, prompt=PROMPTS[:2], lora_path=["one", None], n=2)
    assert got == [_completion(lora_url, prompt=PROMPTS[0], lora_path="one")[0]] * 2 + [
        _completion(lora_url, prompt=PROMPTS[1])[0]] * 2
    # token-id prompts
    ids = [[5, 6, 7], [8, 9, 10]]
    got = _completion(lora_url, prompt=ids, lora_path=["two", "one"])
    assert got == [_completion(lora_url, prompt=ids[0], lora_path="two")[0],
                   _completion(lora_url, prompt=ids[1], lora_path="one")[0]]


@pytest.mark.parametrize("body,message", [
    ({"prompt": PROMPTS, "lora_path": ["one", "two"]}, "lora_path has 2 entries for 3 prompts"),
    ({"prompt": PROMPTS[:1], "lora_path": ["one", "two"]}, "lora_path has 2 entries for 1 prompts"),
    ({"prompt": PROMPTS[0], "lora_path": ["one"]}, "one prompt takes one adapter name"),
    ({"prompt": [1, 2, 3], "lora_path": ["one"]}, "one prompt takes one adapter name"),
])
def test_completions_lora_path_list_must_match_the_prompts(lora_url, body, message):
    assert message in _error(_post(lora_url, "/v1/completions", dict(GREEDY, **body)), "lora_path")


def test_chat_lora_path_is_one_name(lora_url):
    r = _post(lora_url, "/v1/chat/completions", dict(GREEDY, messages=CHAT, lora_path=["one"]))
    assert "one prompt takes one adapter name" in _error(r, "lora_path")
    r = _post(lora_url, "/v1/chat/completions", dict(GREEDY, messages=CHAT, lora_path=1))
    _error(r, "lora_path")  # a schema error names the field too


def test_unknown_adapter_is_the_400_generate_gives(lora_url):
    want = _error(_post(lora_url, "/generate", {"text": "hi", "lora_path": "nope"}), "lora_path")
    assert "'nope'" in want
    assert _error(_post(lora_url, "/v1/completions", dict(GREEDY, prompt="hi", lora_path="nope")), "lora_path") == want
    r = _post(lora_url, "/v1/chat/completions", dict(GREEDY, messages=CHAT, lora_path="nope"))
    assert _error(r, "lora_path") == want
    # one entry of a list: named by its index, as /generate names it in a batch
    want = _error(_post(lora_url, "/generate", {"text": ["a", "b"], "lora_path": ["one", "nope"]}), "lora_path.1")
    r = _post(lora_url, "/v1/completions", dict(GREEDY, prompt=["a", "b"], lora_path=["one", "nope"]))
    assert _error(r, "lora_path.1") == want
    # an empty name
    want = _error(_post(lora_url, "/generate", {"text": "hi", "lora_path": ""}), "lora_path")
    assert _error(_post(lora_url, "/v1/completions", dict(GREEDY, prompt="hi", lora_path="")), "lora_path") == want


@pytest.mark.parametrize("route,prompt", [("/v1/completions", {"prompt": "hi"}),
                                          ("/v1/chat/completions", {"messages": CHAT})])
def test_model_suffix_and_lora_path_must_agree(lora_url, route, prompt):
    for model in ("demo:one", "one"):
        message = _error(_post(lora_url, route, dict(GREEDY, model=model, lora_path="two", **prompt)), "lora_path")
        assert f"model {model!r}" in message and "'one'" in message and "lora_path" in message and "'two'" in message
    # an unknown adapter in `model` stays its 404, whatever lora_path says
    r = _post(lora_url, route, dict(GREEDY, model="demo:nope", lora_path="one", **prompt))
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text


def test_model_suffix_and_a_lora_path_list(lora_url):
    """With `model` naming an adapter every entry must name it too; a null entry (the base model) disagrees."""
    assert _completion(lora_url, model="demo:one", prompt=PROMPTS[:2], lora_path=["one", "one"]) == \
        _completion(lora_url, prompt=PROMPTS[:2], lora_path="one")
    r = _post(lora_url, "/v1/completions", dict(GREEDY, model="demo:one", prompt=PROMPTS[:2], lora_path=["one", None]))
    assert "the base model" in _error(r, "lora_path.1")


def test_responses_has_no_lora_path(lora_url):
    r = _post(lora_url, "/v1/responses", {"input": "hi", "max_output_tokens": 2, "lora_path": "one"})
    assert "unknown field" in _error(r, "lora_path")
    r = _post(lora_url, "/v1/responses", {"input": "hi", "max_output_tokens": 2, "model": "demo:one"})
    assert r.status_code == 200, r.text  # its adapter is asked for by `model`


def test_lora_off_is_the_400_generate_gives():
    with serve_in_thread(model_path=str(DEMO), dtype="float32", served_model_name="demo") as url:
        want = _error(_post(url, "/generate", {"text": "hi", "lora_path": "one"}), "lora_path")
        assert "LoRA is not enabled" in want
        assert _error(_post(url, "/v1/completions", dict(GREEDY, prompt="hi", lora_path="one")), "lora_path") == want
        r = _post(url, "/v1/chat/completions", dict(GREEDY, messages=CHAT, lora_path="one"))
        assert _error(r, "lora_path") == want
        r = _post(url, "/v1/completions", dict(GREEDY, prompt=["a", "b"], lora_path=[None, "one"]))
        assert _error(r, "lora_path.1") == want
        # null (and null entries) ask for the base model: fine without LoRA
        assert _completion(url, prompt=["a", "b"], lora_path=[None, None]) == _completion(url, prompt=["a", "b"])
        assert _chat(url, lora_path=None) == _chat(url)
