"""Tool-call parsers on recorded outputs of each format: whole, streamed in any chunking (also inside
tags), and malformed calls (left as content, no crash); the OpenAI message and deltas they give."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmoe.config import TOOL_CALL_PARSERS
from hybridmoe.server.parsers.chat_output import ChatOutput, assemble
from hybridmoe.server.parsers.reasoning import REASONING_FORMATS, ReasoningParser
from hybridmoe.server.parsers.tool_calls import ToolCallParser
from hybridmoe.server.parsers.tool_formats import TOOL_CALL_FORMATS

NAMES = {"get_weather", "search"}
W = '{"city": "Paris", "unit": "c"}'
S = '{"q": "a }\\n``` tricky <tool_call> string", "n": {"deep": [1, {"x": null}]}}'

# (format, output, expected content, expected [(name, arguments)]); as the models write them
CASES = [
    ("qwen25", f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>', None, [("get_weather", W)]),
    ("qwen25", f'Let me look.\n\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n'
               f'<tool_call>\n{{"name": "search", "parameters": {S}}}\n</tool_call>', "Let me look.",
     [("get_weather", W), ("search", S)]),
    ("qwen25", "No tools needed: 2 < 3 and <b>bold</b>.", "No tools needed: 2 < 3 and <b>bold</b>.", []),
    ("deepseekv3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                   f"{W}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None, [("get_weather", W)]),
    ("deepseekv3", "Two calls.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                   f"```json\n{W}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n"
                   f"{S}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Two calls.", [("get_weather", W), ("search", S)]),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                f"{W}<|tool_call_end|><|tool_calls_section_end|>", None, [("get_weather", W)]),
    ("kimi_k2", "Checking both. <|tool_calls_section_begin|>\n<|tool_call_begin|>functions.get_weather:0"
                f"<|tool_call_argument_begin|>{W}<|tool_call_end|>\n<|tool_call_begin|>functions.search:1"
                f"<|tool_call_argument_begin|>{S}<|tool_call_end|>\n<|tool_calls_section_end|>", "Checking both.",
     [("get_weather", W), ("search", S)]),
]

# malformed calls: the whole text stays content (non-streamed), nothing crashes
MALFORMED = [
    ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>'),  # bad JSON
    ("qwen25", '<tool_call>\n{"name": "unknown_fn", "arguments": {}}\n</tool_call>'),  # not in tools
    ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>'),  # not an object
    ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'),  # cut short
    ("qwen25", '<tool_call>\n["get_weather"]\n</tool_call>'),
    ("deepseekv3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                   '{"city": }\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                "{not json}<|tool_call_end|><|tool_calls_section_end|>"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>get_weather<|tool_call_argument_begin|>{}"),
]


def chunked(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def output(fmt: str, eager: bool, reasoning: str | None = None) -> ChatOutput:
    r = ReasoningParser(REASONING_FORMATS[reasoning]) if reasoning else None
    return ChatOutput(r, ToolCallParser(TOOL_CALL_FORMATS[fmt], NAMES, eager=eager))


def stream(out: ChatOutput, pieces: list[str]) -> list[dict]:
    deltas = [d for p in pieces for d in out.feed(p)]
    return deltas + out.finish()


def calls_of(message: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"] or []]


def test_names_match_the_flag_choices():
    assert tuple(TOOL_CALL_FORMATS) == TOOL_CALL_PARSERS


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_whole(fmt, text, content, calls):
    out = output(fmt, eager=False)
    msg = out.message(text)
    assert msg["content"] == content and calls_of(msg) == calls
    assert all(json.loads(a) == json.loads(b) for (_, a), (_, b) in zip(calls_of(msg), calls))
    assert out.finish_reason("stop") == ("tool_calls" if calls else "stop")
    assert out.finish_reason("length") == "length"
    ids = [c["id"] for c in msg["tool_calls"] or []]
    assert len(set(ids)) == len(ids) and all(c["type"] == "function" for c in msg["tool_calls"] or [])
    if fmt == "kimi_k2":
        assert ids == [f"functions.{n}:{i}" for i, (n, _) in enumerate(calls)]


@settings(max_examples=400, deadline=None, derandomize=True)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 10_000), max_size=16))
def test_streamed_in_any_chunking_adds_up_to_the_whole(case, cuts):
    fmt, text, content, calls = case
    deltas = stream(output(fmt, eager=True), chunked(text, cuts))
    msg = assemble(deltas)
    assert msg["content"] == content and calls_of(msg) == calls
    for d in deltas:  # never a tag fragment in the content
        for tag in TOOL_CALL_FORMATS[fmt].tags():
            assert tag[:3] not in d.get("content", "") or tag[:3] in (content or "")


def test_streaming_emits_the_name_first_then_argument_deltas():
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>'
    deltas = stream(output("qwen25", eager=True), list(text))
    calls = [d["tool_calls"][0] for d in deltas]
    assert len(deltas) == len(calls)  # no content at all
    first = calls[0]
    assert first["function"] == {"name": "get_weather", "arguments": "{"} or first["function"]["arguments"] == ""
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert len(calls) > 10 and all("id" not in c and "name" not in c["function"] for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == W


@pytest.mark.parametrize("fmt,text", MALFORMED)
def test_malformed_calls_are_left_as_content(fmt, text):
    msg = output(fmt, eager=False).message(text)
    assert msg["tool_calls"] is None and msg["content"] == text.strip()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(case=st.sampled_from(MALFORMED), cuts=st.lists(st.integers(0, 10_000), max_size=16))
def test_malformed_calls_streamed_do_not_crash(case, cuts):
    fmt, text = case
    out = output(fmt, eager=True)
    msg = assemble(stream(out, chunked(text, cuts)))
    if msg["tool_calls"] is None:  # never began: all of it is content, as non-streamed
        assert msg["content"] == text.strip()
    else:  # began as a call before it proved malformed: the one call, closed as it stood
        assert len(msg["tool_calls"]) == 1 and msg["tool_calls"][0]["function"]["name"] == "get_weather"


@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=st.text(st.sampled_from(list('<>{}"tool_call/n: \n`|▁｜')), max_size=60),
       cuts=st.lists(st.integers(0, 100), max_size=8), fmt=st.sampled_from(list(TOOL_CALL_FORMATS)))
def test_random_text_never_crashes_and_whole_equals_streamed(text, cuts, fmt):
    whole = output(fmt, eager=False).message(text)
    streamed = assemble(stream(output(fmt, eager=False), chunked(text, cuts)))
    assert whole == dict(streamed, tool_calls=whole["tool_calls"]) if whole["tool_calls"] else whole == streamed
    assert whole["tool_calls"] is None  # no well-formed call can come out of these characters


def test_reasoning_then_tool_call_qwen3():
    text = ('<think>\nThe user asks for the weather; I should call get_weather.\n</think>\n\n'
            f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>')
    msg = output("qwen25", eager=False, reasoning="qwen3").message(text)
    assert msg["reasoning_content"] == "The user asks for the weather; I should call get_weather."
    assert msg["content"] is None and calls_of(msg) == [("get_weather", W)]
    for cuts in ([5, 9, 60, 61, 62, 100], list(range(0, len(text), 3))):
        deltas = stream(output("qwen25", eager=True, reasoning="qwen3"), chunked(text, cuts))
        assert assemble(deltas) == dict(msg, tool_calls=assemble(deltas)["tool_calls"])
        assert calls_of(assemble(deltas)) == calls_of(msg)
        kinds = [next(iter(d)) for d in deltas]
        assert kinds[0] == "reasoning_content" and set(kinds) == {"reasoning_content", "tool_calls"}
