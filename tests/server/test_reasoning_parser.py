"""Reasoning parsers on recorded outputs of each format, whole and streamed in every kind of chunking."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmoe.config import REASONING_PARSERS
from hybridmoe.server.parsers.reasoning import REASONING_FORMATS, ReasoningParser, starts_in_reasoning


def chunked(text: str, cuts: list[int]) -> list[str]:
    """text split at the given cut points (any positions, so also inside tags)."""
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def streamed(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning, answer = "", ""
    for p in pieces:
        r, a = parser.feed(p)
        reasoning, answer = reasoning + r, answer + a
    r, a = parser.finish()
    return reasoning + r, answer + a


# (parser, output, expected reasoning, expected answer); recorded shapes of each model family
CASES = [
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
     "The user greets me.", "Hello! How can I help?"),
    ("qwen3", "<think>\n\n</think>\n\nNo thinking here.", "", "No thinking here."),
    ("qwen3", "Plain answer, thinking off.", None, "Plain answer, thinking off."),
    ("qwen3", "<think>Let me call a tool.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
     "Let me call a tool.", "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>"),
    ("qwen3", "<think>cut short by max_tokens", "cut short by max_tokens", ""),
    ("qwen3", "a < b and <thinking> is not a tag", None, "a < b and <thinking> is not a tag"),
    ("deepseek-r1", "Okay, 1+3 is 4.\n</think>\n\nThe answer is 4.", "Okay, 1+3 is 4.", "The answer is 4."),
    ("deepseek-r1", "<think>\nR1-0528 opens the tag itself.</think>Four.", "R1-0528 opens the tag itself.", "Four."),
    ("deepseek-r1", "never closed", "never closed", ""),
    ("kimi", "◁think▷The user wants a haiku.◁/think▷Autumn moonlight—", "The user wants a haiku.", "Autumn moonlight—"),
    ("kimi", "No thinking.", None, "No thinking."),
    ("kimi_k2", "<think>I will search.<|tool_calls_section_begin|><|tool_call_begin|>functions.s:0"
     "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>", "I will search.",
     "<|tool_calls_section_begin|><|tool_call_begin|>functions.s:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
     "<|tool_calls_section_end|>"),
]


def test_names_match_the_flag_choices():
    assert tuple(REASONING_FORMATS) == REASONING_PARSERS


@pytest.mark.parametrize("name,text,reasoning,answer", CASES)
def test_whole(name, text, reasoning, answer):
    got = ReasoningParser(REASONING_FORMATS[name]).parse(text)
    assert got == (reasoning or "", answer)


@pytest.mark.parametrize("name,text,reasoning,answer", CASES)
def test_one_character_at_a_time(name, text, reasoning, answer):
    assert streamed(ReasoningParser(REASONING_FORMATS[name]), list(text)) == (reasoning or "", answer)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 10_000), max_size=12), hold=st.booleans())
def test_any_chunking_gives_the_whole_result(case, cuts, hold):
    name, text, reasoning, answer = case
    parser = ReasoningParser(REASONING_FORMATS[name], stream_reasoning=not hold)
    assert streamed(parser, chunked(text, cuts)) == (reasoning or "", answer)


def test_stream_reasoning_false_sends_the_reasoning_in_one_piece():
    parser = ReasoningParser(REASONING_FORMATS["qwen3"], stream_reasoning=False)
    out = [parser.feed(c) for c in ["<think>", "a b", " c", "</think>", "done"]] + [parser.finish()]
    assert [r for r, _ in out if r] == ["a b c"]
    assert "".join(a for _, a in out) == "done"


def test_streamed_reasoning_is_not_held_back_longer_than_a_partial_tag():
    parser = ReasoningParser(REASONING_FORMATS["qwen3"])
    assert parser.feed("<think>step one") == ("step one", "")
    assert parser.feed(" then</th") == (" then", "")  # "</th" may be the end tag: held
    assert parser.feed("ink>ok") == ("", "ok")


def test_prompt_that_opens_the_thinking_part():
    fmt = REASONING_FORMATS["qwen3"]
    assert starts_in_reasoning(fmt, "<|im_start|>assistant\n<think>\n")
    assert not starts_in_reasoning(fmt, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not starts_in_reasoning(fmt, "<|im_start|>assistant\n")
    assert starts_in_reasoning(REASONING_FORMATS["deepseek-r1"], "")
    parser = ReasoningParser(fmt, in_reasoning=True)
    assert parser.parse("thinking already\n</think>\n\nanswer") == ("thinking already", "answer")
