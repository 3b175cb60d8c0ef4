"""The chat route's response assembly driven with recorded model text: a Qwen3-style answer with
`<think>...</think>` and a `<tool_call>` block, split into reasoning_content and tool_calls, streamed
(the route's own SSE generator over a RequestStream fed the recorded outputs) and not."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from hybridmoe.config import ServerConfig
from hybridmoe.server.chat_tools import plan_chat, template_message, template_tools
from hybridmoe.server.errors import APIError
from hybridmoe.server.openai_api import _chat_events
from hybridmoe.server.parsers.chat_output import assemble
from hybridmoe.server.protocol import ChatCompletionRequest

ANSWER = ('<think>\nThe user wants the weather in Paris. I will call get_weather.\n</think>\n\n'
          'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                                          "unit": {"enum": ["c", "f"]}}}}}]
QWEN = ServerConfig(tool_call_parser="qwen25", reasoning_parser="qwen3")


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "weather?"}], **kw})


def plan(cfg: ServerConfig = QWEN, **kw):
    return asyncio.run(plan_chat(cfg, request(**kw), {}))


def outputs(text: str, cuts: list[int], reason: str = "stop") -> list[dict]:
    """Cumulative engine outputs of text, cut at the given points."""
    points = sorted(set(cuts) | {len(text)})
    outs = []
    for i, p in enumerate(points):
        last = i == len(points) - 1
        outs.append({"text": text[:p], "meta_info": {"finish_reason": {"type": reason} if last else None,
                                                     "completion_tokens": i + 1, "prompt_tokens": 3,
                                                     "cached_tokens": 0}})
    return outs


async def _stream_events(body: ChatCompletionRequest, p, outs: list[dict]) -> list[dict]:
    from hybridmoe.server.async_engine import RequestStream

    stream = RequestStream("r1")
    events = []
    gen = _chat_events([stream], SimpleNamespace(params=SimpleNamespace(stop_strs=[])), {"id": "x"},
                       lambda t: str(t), body, [p.output("", eager=True)])
    async def produce() -> None:
        for out in outs:  # one output at a time, as the engine sends them
            while not stream.queue.empty():  # the route took the last one (else they would coalesce)
                await asyncio.sleep(0.001)
            stream.queue.put_nowait(out)

    async def consume() -> None:
        async for e in gen:
            events.append(e)

    await asyncio.wait_for(asyncio.gather(produce(), consume()), 30)
    data = [e.decode()[6:].strip() for e in events]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_whole_answer_split():
    p = plan(tools=TOOLS)
    out = p.output("", eager=False)
    msg = out.message(ANSWER)
    assert msg["reasoning_content"] == "The user wants the weather in Paris. I will call get_weather."
    assert msg["content"] == "Checking."
    [call] = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert out.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("cuts", [[], [1, 2, 3, 8, 9, 30, 74, 75, 76, 90, 100, 101, 102, 150],
                                  list(range(0, len(ANSWER), 2)), list(range(0, len(ANSWER), 7))])
def test_streamed_answer_split(cuts):
    body = request(tools=TOOLS, stream=True)
    events = asyncio.run(_stream_events(body, plan(tools=TOOLS), outputs(ANSWER, cuts)))
    choices = [e["choices"][0] for e in events]
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["delta"] for c in choices[1:]]
    msg = assemble(deltas)
    whole = plan(tools=TOOLS).output("", eager=False).message(ANSWER)
    assert {k: msg[k] for k in ("content", "reasoning_content")} == {k: whole[k] for k in ("content", "reasoning_content")}
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == \
           [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["tool_calls"]
    assert all("<think>" not in d.get("content", "") and "<tool_call>" not in d.get("content", "") for d in deltas)


def test_no_parsers_passes_the_text_through():
    p = plan(ServerConfig(), tools=TOOLS)
    out = p.output("", eager=False)
    assert not out.active and p.tool_format is None and p.reasoning_format is None
    body = request(stream=True)
    events = asyncio.run(_stream_events(body, p, outputs(ANSWER, [10, 20])))
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == ANSWER
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_tool_choice_none_and_separate_reasoning_false():
    p = plan(tools=TOOLS, tool_choice="none", separate_reasoning=False)
    assert p.tool_format is None and p.reasoning_format is None
    assert template_tools(request(tools=TOOLS, tool_choice="none")) is None
    assert template_tools(request(tools=TOOLS))[0]["function"]["name"] == "get_weather"


def test_forced_tool_choice_sets_the_grammar():
    pytest.importorskip("xgrammar")
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        params: dict = {}
        p = asyncio.run(plan_chat(QWEN, request(tools=TOOLS, tool_choice=choice), params))
        assert p.forced and params["ebnf"].startswith("root ::= ")
        assert p.output("<think>\n", eager=False).reasoning.state != "reasoning"  # the calls come first
    with pytest.raises(APIError, match="one of them"):
        asyncio.run(plan_chat(QWEN, request(tools=TOOLS, tool_choice="required"), {"json_schema": "{}"}))


@pytest.mark.parametrize("kw,cfg,word", [
    ({"tool_choice": "required"}, QWEN, "requires tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, QWEN, "not in tools"),
    ({"tools": TOOLS, "tool_choice": "required"}, ServerConfig(), "--tool-call-parser"),
])
def test_tool_choice_refused(kw, cfg, word):
    with pytest.raises(APIError, match=word) as e:
        plan(cfg, **kw)
    assert e.value.status == 400 and e.value.param == "tool_choice"


def test_history_tool_calls_reach_the_template_as_objects():
    msg = {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    assert template_message(msg)["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    odd = {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                "function": {"name": "f", "arguments": "not json"}}]}
    assert template_message(odd)["tool_calls"][0]["function"]["arguments"] == "not json"
