"""The EBNF that forces tool calls: compiled by xgrammar, it accepts well-formed calls in the parser's
format (which the parser then reads back) and rejects anything else."""

from __future__ import annotations

import json

import pytest

from hybridmoe.server.parsers.chat_output import ChatOutput
from hybridmoe.server.parsers.tool_calls import ToolCallParser
from hybridmoe.server.parsers.tool_formats import TOOL_CALL_FORMATS
from hybridmoe.server.parsers.tool_grammar import ToolGrammarError, ebnf_literal, rename_rules, tool_call_ebnf

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string as accepts  # noqa: E402

WEATHER = {"name": "get_weather", "description": "weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                           "unit": {"type": "string", "enum": ["c", "f"]},
                                                           "days": {"type": "integer"}},
                          "required": ["city", "unit"]}}
NOARGS = {"name": "now"}
TOOLS = [WEATHER, NOARGS]
ARGS = '{"city": "Paris", "unit": "c"}'


def call(fmt: str, name: str, args: str, idx: int = 0) -> str:
    if fmt == "qwen25":
        return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'
    if fmt == "deepseekv3":
        return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"
    return f"<|tool_call_begin|>functions.{name}:{idx}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


def wrap(fmt: str, *calls: str) -> str:
    if fmt == "qwen25":
        return "\n".join(calls)
    f = TOOL_CALL_FORMATS[fmt]
    return f.section_begin + "".join(calls) + f.section_end


def grammar(fmt: str, **kw):
    return xgr.Grammar.from_ebnf(tool_call_ebnf(TOOL_CALL_FORMATS[fmt], TOOLS, **kw), root_rule_name="root")


@pytest.mark.parametrize("fmt", list(TOOL_CALL_FORMATS))
def test_accepts_calls_the_parser_reads_back(fmt):
    g = grammar(fmt)
    texts = [wrap(fmt, call(fmt, "get_weather", ARGS)),
             wrap(fmt, call(fmt, "get_weather", '{"city": "Oslo", "unit": "f", "days": 3}')),
             wrap(fmt, call(fmt, "now", "{}")),
             wrap(fmt, call(fmt, "get_weather", ARGS), call(fmt, "now", "{}", 1))]
    for text in texts:
        assert accepts(g, text), text
        msg = ChatOutput(None, ToolCallParser(TOOL_CALL_FORMATS[fmt], {"get_weather", "now"}, eager=False)).message(text)
        assert msg["tool_calls"] and msg["content"] is None
        for c in msg["tool_calls"]:
            assert isinstance(json.loads(c["function"]["arguments"]), dict)


@pytest.mark.parametrize("fmt", list(TOOL_CALL_FORMATS))
def test_rejects_what_does_not_follow_the_schemas(fmt):
    g = grammar(fmt)
    bad = [wrap(fmt, call(fmt, "get_weather", '{"city": "Paris"}')),  # a required property missing
           wrap(fmt, call(fmt, "get_weather", '{"city": "Paris", "unit": "k"}')),  # not in the enum
           wrap(fmt, call(fmt, "get_weather", '{"city": 5, "unit": "c"}')),  # wrong type
           wrap(fmt, call(fmt, "get_weather", '{"city": "Paris", "unit": "c", "extra": 1}')),  # strict
           wrap(fmt, call(fmt, "other", "{}")),  # not a tool
           wrap(fmt, call(fmt, "now", '{"x": 1}')),  # no parameters: the empty object only
           "Sure! " + wrap(fmt, call(fmt, "now", "{}")),  # text before the calls
           "", "I cannot call tools."]
    for text in bad:
        assert not accepts(g, text), text


@pytest.mark.parametrize("fmt", list(TOOL_CALL_FORMATS))
def test_named_and_single_call(fmt):
    one = wrap(fmt, call(fmt, "get_weather", ARGS))
    two = wrap(fmt, call(fmt, "get_weather", ARGS), call(fmt, "get_weather", ARGS, 1))
    named = grammar(fmt, only="get_weather")
    assert accepts(named, one) and not accepts(named, two)
    assert not accepts(named, wrap(fmt, call(fmt, "now", "{}")))
    single = grammar(fmt, parallel=False)
    assert accepts(single, one) and accepts(single, wrap(fmt, call(fmt, "now", "{}"))) and not accepts(single, two)


def test_rename_leaves_literals_and_classes_alone():
    src = 'root ::= "root a\\"b" [a-z\\]root] item\nitem ::= ("x" | root){0, -1}\n'
    assert rename_rules(src, "p_") == 'p_root ::= "root a\\"b" [a-z\\]root] p_item\np_item ::= ("x" | p_root){0, -1}\n'


def test_literal_escapes():
    text = 'a"b\\c\n｜▁'
    g = xgr.Grammar.from_ebnf("root ::= " + ebnf_literal(text), root_rule_name="root")
    assert accepts(g, text) and not accepts(g, "abc")


def test_bad_schema_and_unknown_name():
    with pytest.raises(ToolGrammarError, match="get_weather"):
        tool_call_ebnf(TOOL_CALL_FORMATS["qwen25"], [{"name": "get_weather", "parameters": {"type": "nonsense"}}])
    with pytest.raises(ToolGrammarError):
        tool_call_ebnf(TOOL_CALL_FORMATS["qwen25"], TOOLS, only="missing")
