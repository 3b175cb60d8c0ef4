"""Tool calling and reasoning against a real server (demo model) with the official `openai` client:
tools reach the chat template, tool history is accepted, bad requests get 400s, the flags refuse
unknown names, and tool_choice required / a named function always give parseable tool_calls (the
grammar that forces them needs the engine's `ebnf` support)."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest

from hybridmoe.engine.request import SamplingParams
from hybridmoe.launch_server import build_parser

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
                                                    "unit": {"type": "string", "enum": ["c", "f"]},
                                                    "rain": {"type": "boolean"}},
                   "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, CLOCK]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
# a client template that shows what the template gets: tools included
SHOW_TOOLS = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
              "{% if tools %}TOOLS {{ tools | tojson }}{% endif %}{{ extra | default('') }}assistant:")
HAS_EBNF = "ebnf" in {f.name for f in dataclasses.fields(SamplingParams)}


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server("--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3", "--allow-client-chat-template",
                        "--served-model-name", "demo")


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_tools_reach_the_chat_template(client):
    def prompt_tokens(**kw) -> int:
        r = client.chat.completions.create(model="demo", messages=USER, max_tokens=1,
                                           extra_body={"chat_template_kwargs": {"chat_template": SHOW_TOOLS}}, **kw)
        return r.usage.prompt_tokens

    plain, with_tools = prompt_tokens(), prompt_tokens(tools=TOOLS)
    assert with_tools > plain + 20  # the schemas are in the prompt
    assert prompt_tokens(tools=TOOLS, tool_choice="none") == plain  # "none": the model is not offered tools


def test_chat_template_kwargs_reach_the_template(client):
    def prompt_tokens(kwargs: dict) -> int:
        r = client.chat.completions.create(model="demo", messages=USER, max_tokens=1,
                                           extra_body={"chat_template_kwargs": {"chat_template": SHOW_TOOLS, **kwargs}})
        return r.usage.prompt_tokens

    assert prompt_tokens({"extra": "a b c d e f g h"}) > prompt_tokens({})
    r = client.chat.completions.create(model="demo", messages=USER, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content is not None


def test_reasoning_effort_reaches_the_template_as_its_variable(client):
    """reasoning_effort was refused ("not implemented"); it is the template's `reasoning_effort` variable now (the
    templates that read it, gpt-oss-style, choose their reasoning by it), and chat_template_kwargs' own wins."""
    show = "{{ messages[-1]['content'] }}{% if reasoning_effort is defined %} EFFORT {{ reasoning_effort }}" \
           " a b c d e f{% endif %} assistant:"

    def prompt_tokens(**kw) -> int:
        extra = {"chat_template_kwargs": {"chat_template": show, **kw.pop("kwargs", {})}, **kw}
        return client.chat.completions.create(model="demo", messages=USER, max_tokens=1,
                                              extra_body=extra).usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(reasoning_effort="high") > plain + 3
    assert prompt_tokens(reasoning_effort="high", kwargs={"reasoning_effort": "low " * 8}) > prompt_tokens(
        reasoning_effort="high") + 5  # the client's own kwarg is kept
    r = httpx.post(client.base_url.join("chat/completions").__str__(), json={
        "model": "demo", "messages": USER, "max_tokens": 1, "reasoning_effort": "extreme"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text


def test_tool_history_is_accepted(client):
    messages = USER + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "c"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    r = client.chat.completions.create(model="demo", messages=messages, tools=TOOLS, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_auto_answers_stream_and_not(client):
    r = client.chat.completions.create(model="demo", messages=USER, tools=TOOLS, max_tokens=8, temperature=0)
    msg = r.choices[0].message
    assert msg.role == "assistant" and (msg.content or msg.tool_calls)
    chunks = list(client.chat.completions.create(model="demo", messages=USER, tools=TOOLS, max_tokens=8,
                                                 temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == (msg.content or "")


@pytest.mark.parametrize("body,word", [
    ({"tool_choice": "required"}, "requires tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
    ({"tools": [WEATHER, WEATHER]}, "two tools"),
    ({"tools": [{"type": "retrieval"}]}, "type"),
    ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice"),
    ({"chat_template_kwargs": {"enable_thinking": {"nested": 1}}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tools": "x"}}, "set by the server"),
    ({"chat_template_kwargs": {f"k{i}": i for i in range(40)}}, "keys"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function"}]}]}, "function"),
    ({"tools": [{"type": "function", "function": {"name": "deep", "parameters": json.loads(
        '{"a":' * 40 + "1" + "}" * 40)}}]}, "nested"),
])
def test_bad_tool_requests_get_400(srv, body, word):
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 1, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert word in r.json()["error"]["message"], r.text


def test_two_tools_of_one_name_are_named_in_the_message_and_the_param_is_tools(srv):
    """The message was "two tools are named {name!r}" (pydantic fills {key} only) and its ctx key made the param
    "tools.get_weather"."""
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 1, "tools": [WEATHER] * 2},
                   timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "tools", r.text
    assert f"two tools are named {WEATHER['function']['name']!r}" in err["message"], r.text


@pytest.mark.parametrize("flag", ["--tool-call-parser", "--reasoning-parser"])
def test_unknown_parser_names_are_refused_by_the_flags(flag, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([flag, "no-such-parser"])
    assert e.value.code == 2 and flag in capsys.readouterr().err
    ns = build_parser().parse_args(["--tool-call-parser", "kimi_k2", "--reasoning-parser", "deepseek-r1"])
    assert (ns.tool_call_parser, ns.reasoning_parser) == ("kimi_k2", "deepseek-r1")


@pytest.mark.skipif(not HAS_EBNF, reason="the engine has no `ebnf` sampling parameter yet (the grammar branch)")
@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_choice_always_parses(client, stream):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for i in range(20):
        choice = "required" if i % 2 else named
        kw = dict(model="demo", messages=[{"role": "user", "content": f"question {i}"}], tools=TOOLS,
                  tool_choice=choice, parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=i)
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            calls: dict[int, dict] = {}
            for c in chunks:
                for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                    entry = calls.setdefault(d.index, {"name": None, "arguments": ""})
                    entry["name"] = entry["name"] or (d.function.name if d.function else None)
                    entry["arguments"] += (d.function.arguments or "") if d.function else ""
            reason = chunks[-1].choices[0].finish_reason
            got = [(v["name"], v["arguments"]) for _, v in sorted(calls.items())]
        else:
            r = client.chat.completions.create(**kw)
            reason = r.choices[0].finish_reason
            got = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []]
        assert reason == "tool_calls" and len(got) == 1, (i, reason, got)
        name, args = got[0]
        assert name in ("get_weather", "now") and (choice == "required" or name == "get_weather")
        value = json.loads(args)
        if name == "get_weather":
            assert value["city"] in ("Paris", "Oslo", "Rome") and value["unit"] in ("c", "f")
