"""The grammar that forces tool calls (tool_choice `required` or a named function): xgrammar EBNF
(root rule `root`) of one or more calls in the active parser's format, each call's arguments
following its function's JSON Schema, so the answer always parses into tool_calls.

Each schema is converted by xgrammar (Grammar.from_json_schema, strict: no properties beyond the
schema's) and its rules renamed apart (`t3_...` for the fourth tool), then joined by hand-written
rules for the format's tags. The arguments are compact JSON (`", "` and `": "` separators): no
whitespace loops for a model to get lost in.
"""

from __future__ import annotations

import json
import re
from typing import Any

from hybridmoe.server.parsers.tool_formats import ToolCallFormat

EMPTY_OBJECT = {"type": "object", "properties": {}}
NL = "\n"


class ToolGrammarError(ValueError):
    """A tool's parameters schema cannot be turned into a grammar (the message says which and why)."""


def ebnf_literal(text: str) -> str:
    """text as an EBNF string literal."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def rename_rules(ebnf: str, prefix: str) -> str:
    """Every rule name of an EBNF text prefixed (definitions and references), string literals and
    character classes left as they are."""
    out, i, n = [], 0, len(ebnf)
    while i < n:
        ch = ebnf[i]
        if ch in "\"[":  # a literal or a class: copy to its unescaped end
            close = '"' if ch == '"' else "]"
            j = i + 1
            while j < n and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i:j + 1])
            i = j + 1
        elif ch.isalpha() or ch == "_":
            m = _IDENT.match(ebnf, i)
            assert m is not None
            out.append(prefix + m.group())
            i = m.end()
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def schema_rules(schema: dict[str, Any] | None, prefix: str) -> str:
    """EBNF rules of a JSON Schema, its root rule named `{prefix}root`."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise ToolGrammarError("tool_choice required or named needs xgrammar, not installed on this server: "
                               "pip install 'hybridmoe[structured]'") from None
    try:
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema or EMPTY_OBJECT), any_whitespace=False,
                                               strict_mode=True)
    except Exception as e:  # xgrammar raises RuntimeError/ValueError with its parser's message
        raise ToolGrammarError(str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__) from None
    return rename_rules(str(grammar), prefix)


def _call_rule(fmt: ToolCallFormat, name: str, args: str) -> str:
    """One call of function `name` with arguments rule `args`, in the format's exact text."""
    lit = ebnf_literal
    if fmt.name == "qwen25":
        head = fmt.call_begin + NL + '{"name": ' + json.dumps(name) + ', "arguments": '
        return f"{lit(head)} {args} {lit('}' + NL + fmt.call_end)}"
    if fmt.name == "deepseekv3":
        return f'{lit(fmt.call_begin + "function<｜tool▁sep｜>" + name + NL + "```json" + NL)} {args} ' \
               f'{lit(NL + "```" + fmt.call_end)}'
    if fmt.name == "kimi_k2":
        return f'{lit(fmt.call_begin + "functions." + name + ":")} [0-9]+ {lit("<|tool_call_argument_begin|>")} ' \
               f'{args} {lit(fmt.call_end)}'
    raise ToolGrammarError(f"no grammar for the tool-call format {fmt.name!r}")


def tool_call_ebnf(fmt: ToolCallFormat, tools: list[dict[str, Any]], *, only: str | None = None,
                   parallel: bool = True) -> str:
    """The EBNF that forces tool calls in format `fmt`.

    tools: OpenAI function definitions ({"name", "parameters"?, ...}); only: the one function a
    named tool_choice allows (one call of it); parallel: any number >= 1 of calls (else exactly one).
    ToolGrammarError when a schema does not convert.
    """
    chosen = [t for t in tools if only is None or t["name"] == only]
    if not chosen:
        raise ToolGrammarError(f"no tool is named {only!r}")
    rules, calls = [], []
    for i, tool in enumerate(chosen):
        prefix = f"t{i}_"
        try:
            rules.append(schema_rules(tool.get("parameters"), prefix))
        except ToolGrammarError as e:
            raise ToolGrammarError(f"the parameters of tool {tool['name']!r} cannot be enforced: {e}") from None
        rules.append(f"call_{i} ::= {_call_rule(fmt, tool['name'], prefix + 'root')}")
        calls.append(f"call_{i}")
    rules.append("call ::= " + " | ".join(calls))
    sep = ebnf_literal("\n")
    many = parallel and only is None
    seq = f"call ({sep} call)*" if fmt.name == "qwen25" else f"call ({sep}? call)*"
    seq = seq if many else "call"
    if fmt.section_begin:
        root = f"root ::= {ebnf_literal(fmt.section_begin)} {seq} {ebnf_literal(fmt.section_end or '')}"
    else:
        root = f"root ::= {seq}"
    return root + "\n" + "\n".join(rules) + "\n"
