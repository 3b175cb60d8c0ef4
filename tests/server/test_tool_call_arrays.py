"""hermes/qwen25 tool calls: a <tool_call> block whose body is a JSON array of calls (as SGLang's detector
reads it) gives one call per element, the indices running on across elements and blocks; `[]` gives none;
an array with a malformed element is a malformed block (its text is content, as a malformed call's is);
streamed in any chunking, the same calls and indices as the whole answer."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmoe.server.parsers.chat_output import ChatOutput, assemble
from hybridmoe.server.parsers.tool_calls import ToolCallParser, json_array_items
from hybridmoe.server.parsers.tool_formats import TOOL_CALL_FORMATS

NAMES = {"get_weather", "search"}
W = '{"city": "Paris", "unit": "c"}'
S = '{"q": "a ] }\\n[ tricky </tool_call string", "n": {"deep": [1, {"x": null}]}}'
GW = f'{{"name": "get_weather", "arguments": {W}}}'
SP = f'{{"name": "search", "parameters": {S}}}'  # "parameters" for "arguments", as in one call

ARRAY2 = f"<tool_call>\n[{GW}, {SP}]\n</tool_call>"
ONE = f"<tool_call>\n{GW}\n</tool_call>"

# (output, expected content, expected [(name, arguments)] in index order)
CASES = [
    (ARRAY2, None, [("get_weather", W), ("search", S)]),
    (f"Both at once.\n\n<tool_call>\n[\n  {GW},\n  {SP}\n]\n</tool_call>", "Both at once.",
     [("get_weather", W), ("search", S)]),
    (f"{ARRAY2}\n{ONE}", None, [("get_weather", W), ("search", S), ("get_weather", W)]),
    (f"{ONE}\n{ARRAY2}", None, [("get_weather", W), ("get_weather", W), ("search", S)]),
    (f"<tool_call>[{SP}]</tool_call>", None, [("search", S)]),
    ("<tool_call>\n[]\n</tool_call>", "", []),
    (f"Nothing to do.<tool_call>[ ]</tool_call>\n{ONE}", "Nothing to do.", [("get_weather", W)]),
]

# arrays holding an element that is not a well-formed call: the block is malformed as a whole
BAD_ARRAYS = [
    f'<tool_call>\n[{GW}, "search"]\n</tool_call>',  # not an object
    f'<tool_call>\n[{GW}, {{"name": 7, "arguments": {{}}}}]\n</tool_call>',  # name not a string
    f'<tool_call>\n[{GW}, {{"arguments": {W}}}]\n</tool_call>',  # no name
    f'<tool_call>\n[{GW}, {{"name": "unknown_fn", "arguments": {{}}}}]\n</tool_call>',  # not in tools
    f'<tool_call>\n[{GW}, {{"name": "search", "arguments": [1, 2]}}]\n</tool_call>',  # arguments not an object
    f'<tool_call>\n[{GW}, {{"name": "search"}}]\n</tool_call>',  # no arguments
    f"<tool_call>\n[{GW}, {SP},]\n</tool_call>",  # not JSON
    f"<tool_call>\n[{GW}, {SP}] and more\n</tool_call>",  # text after the array
    f"<tool_call>\n[{GW}, {SP}]",  # cut short
    f"<tool_call>\n[{GW}" + "[" * 5000 + "\n</tool_call>",  # deep nesting, unclosed
    f'<tool_call>\n[{GW}, {{"name": "search", "arguments": {{"q": ' + "[" * 100_000 + "]" * 100_000
    + "}}]\n</tool_call>",  # nested past json's recursion limit
]


def chunked(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def output(eager: bool, fmt: str = "qwen25") -> ChatOutput:
    return ChatOutput(None, ToolCallParser(TOOL_CALL_FORMATS[fmt], NAMES, eager=eager))


def stream(out: ChatOutput, pieces: list[str]) -> list[dict]:
    deltas = [d for p in pieces for d in out.feed(p)]
    return deltas + out.finish()


def calls_of(message: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"] or []]


def indices(deltas: list[dict]) -> list[int]:
    """The indices of the calls the deltas begin, in order."""
    return [c["index"] for d in deltas for c in d.get("tool_calls", []) if "id" in c]


def events(text: str, eager: bool, pieces: list[str] | None = None) -> list[tuple]:
    p = ToolCallParser(TOOL_CALL_FORMATS["qwen25"], NAMES, eager=eager)
    evs = [e for piece in (pieces or [text]) for e in p.feed(piece)]
    return evs + p.finish()


def test_array_of_two_calls_gives_two_calls_indexed_0_1():
    evs = events(ARRAY2, eager=False)
    assert [(e[0], e[1], e[3]) for e in evs if e[0] == "call"] == [("call", 0, "get_weather"), ("call", 1, "search")]
    assert [(e[1], e[2]) for e in evs if e[0] == "args"] == [(0, W), (1, S)]
    assert not [e for e in evs if e[0] == "content"]
    out = output(eager=False)
    msg = out.message(ARRAY2)
    assert msg["content"] is None and calls_of(msg) == [("get_weather", W), ("search", S)]
    assert [json.loads(a) for _, a in calls_of(msg)] == [json.loads(W), json.loads(S)]
    ids = [c["id"] for c in msg["tool_calls"]]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert out.finish_reason("stop") == "tool_calls"


def test_array_block_then_object_block_continues_the_indices():
    evs = events(f"{ARRAY2}\n{ONE}", eager=False)
    assert [(e[1], e[3]) for e in evs if e[0] == "call"] == [(0, "get_weather"), (1, "search"), (2, "get_weather")]
    assert [e[1] for e in evs if e[0] == "args"] == [0, 1, 2]
    evs = events(f"{ONE}\n{ARRAY2}\n{ARRAY2}", eager=True)
    assert [e[1] for e in evs if e[0] == "call"] == [0, 1, 2, 3, 4]


def test_empty_array_gives_no_call():
    msg = output(eager=False).message("<tool_call>\n[]\n</tool_call>")
    assert msg["tool_calls"] is None and msg == output(eager=False).message("")  # as an empty answer: content ""
    out = output(eager=False)
    deltas = stream(out, [f"Let me see.<tool_call>[]</tool_call>\n{ONE}\n<tool_call>[ ]</tool_call>{ONE}"])
    msg = assemble(deltas)
    assert msg["content"] == "Let me see." and calls_of(msg) == [("get_weather", W)] * 2
    assert indices(deltas) == [0, 1]  # no index taken by the empty blocks
    assert out.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("text,content,calls", CASES)
def test_whole(text, content, calls):
    out = output(eager=False)
    msg = out.message(text)
    assert msg["content"] == content and calls_of(msg) == calls
    assert out.finish_reason("stop") == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize("text", BAD_ARRAYS)
def test_an_array_with_a_malformed_element_is_left_as_content(text):
    # as a malformed single call: no call, the whole text is content; eager or not
    for eager in (False, True):
        msg = output(eager=eager).message(text)
        assert msg["tool_calls"] is None and msg["content"] == text.strip()


def test_a_malformed_array_between_good_blocks():
    bad = BAD_ARRAYS[0]
    text = f"{ARRAY2}\n{bad}\n{ONE}"
    deltas = stream(output(eager=False), [text])
    msg = assemble(deltas)
    assert msg["content"] == bad  # the malformed block, as written; the calls around it stand
    assert calls_of(msg) == [("get_weather", W), ("search", S), ("get_weather", W)]
    assert indices(deltas) == [0, 1, 2]
    # the same as a malformed single call in its place
    single = '<tool_call>\n{"name": "unknown_fn", "arguments": {}}\n</tool_call>'
    msg2 = output(eager=False).message(f"{ARRAY2}\n{single}\n{ONE}")
    assert msg2["content"] == single and calls_of(msg2) == calls_of(msg)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 10_000), max_size=16))
def test_streamed_in_any_chunking_equals_the_whole(case, cuts):
    text, content, calls = case
    whole_deltas = stream(output(eager=False), [text])
    whole = assemble(whole_deltas)
    deltas = stream(output(eager=True), chunked(text, cuts))
    msg = assemble(deltas)
    assert msg["content"] == whole["content"] == content
    assert calls_of(msg) == calls_of(whole) == calls
    assert indices(deltas) == indices(whole_deltas) == list(range(len(calls)))
    # the parser's own events: the same calls, indices and arguments as the non-streamed parse
    pieces = chunked(text, cuts)
    plain = [(e[0], e[1], e[3]) if e[0] == "call" else e for e in events(text, eager=False) if e[0] != "content"]
    streamed = [(e[0], e[1], e[3]) if e[0] == "call" else e for e in events(text, True, pieces) if e[0] != "content"]
    joined: list[tuple] = []
    for e in streamed:  # argument pieces of one call joined
        if joined and e[0] == "args" and joined[-1][0] == "args" and joined[-1][1] == e[1]:
            joined[-1] = ("args", e[1], joined[-1][2] + e[2])
        else:
            joined.append(e)
    assert joined == plain


@settings(max_examples=200, deadline=None, derandomize=True)
@given(case=st.sampled_from(BAD_ARRAYS[:-2]), cuts=st.lists(st.integers(0, 10_000), max_size=16))
def test_malformed_arrays_streamed_are_content_as_whole(case, cuts):
    msg = assemble(stream(output(eager=True), chunked(case, cuts)))
    assert msg["tool_calls"] is None and msg["content"] == case.strip()


def test_only_the_hermes_format_reads_arrays():
    assert [n for n, f in TOOL_CALL_FORMATS.items() if f.arrays] == ["qwen25"]
    text = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            f"[{W}]\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    msg = output(eager=False, fmt="deepseekv3").message(text)
    assert msg["tool_calls"] is None and msg["content"] == text


def test_json_array_items_bounded():
    assert json_array_items(" [ ] ") == []
    assert json_array_items('[{"a": [1]}, "x" ]') == ['{"a": [1]}', '"x"']
    for bad in ("[", "[1,]", "[1 2]", "[1]x", "{}", "", "[" * 100_000 + "]" * 100_000):  # the last: too deep
        assert json_array_items(bad) is None  # never raises
    # many calls in one block: linear, each one a call, indices in order
    n = 5000
    text = "<tool_call>[" + ", ".join([GW] * n) + "]</tool_call>"
    t0 = time.perf_counter()
    evs = events(text, eager=True, pieces=chunked(text, list(range(0, len(text), 97))))
    assert time.perf_counter() - t0 < 10
    assert [e[1] for e in evs if e[0] == "call"] == list(range(n))
