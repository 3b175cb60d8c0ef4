"""Tool calling and reasoning on /v1/chat/completions: what the chat template gets (tools, the history's
tool calls), the grammar a forced tool_choice adds to the request, and the parser of the answer.

The formats live in parsers/; this module checks a request against the server's --tool-call-parser and
--reasoning-parser and turns it into a `ChatPlan`.
"""

from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import dataclass
from typing import Any

from hybridmoe.config import ServerConfig
from hybridmoe.server.errors import APIError
from hybridmoe.server.parsers.chat_output import ChatOutput
from hybridmoe.server.parsers.reasoning import REASONING_FORMATS, ReasoningFormat, ReasoningParser, starts_in_reasoning
from hybridmoe.server.parsers.tool_calls import ToolCallParser
from hybridmoe.server.parsers.tool_formats import TOOL_CALL_FORMATS, ToolCallFormat
from hybridmoe.server.parsers.tool_grammar import ToolGrammarError, tool_call_ebnf
from hybridmoe.server.tool_protocol import tool_name_choice

GRAMMAR_PARAMS = ("json_schema", "regex", "ebnf")
PROMPT_TAIL_TOKENS = 16  # enough to see whether the prompt ends inside an open thinking part


def _functions(body: Any) -> list[dict[str, Any]]:
    return [t.function.model_dump(exclude_none=True) for t in body.tools or []]


def template_tools(body: Any) -> list[dict[str, Any]] | None:
    """The `tools` variable of the chat template (OpenAI's shape, as Hugging Face templates expect):
    none with tool_choice none."""
    if not body.tools or body.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools]


def template_message(msg: dict[str, Any]) -> dict[str, Any]:
    """A history message for the template: a tool call's arguments as an object where they are one
    (templates render them with tojson; a string would be quoted twice)."""
    calls = msg.get("tool_calls")
    if not calls:
        return msg
    out = []
    for call in calls:
        fn = dict(call["function"])
        try:
            args = json.loads(fn["arguments"])
        except (ValueError, RecursionError):
            args = None
        if isinstance(args, dict):
            fn["arguments"] = args
        out.append(dict(call, function=fn))
    return dict(msg, tool_calls=out)


@functools.lru_cache(maxsize=64)
def _ebnf(fmt_name: str, tools_json: str, only: str | None, parallel: bool) -> str:
    return tool_call_ebnf(TOOL_CALL_FORMATS[fmt_name], json.loads(tools_json), only=only, parallel=parallel)


@dataclass(frozen=True)
class ChatPlan:
    """How one chat request's answer is constrained and parsed."""

    tool_format: ToolCallFormat | None = None  # parse tool calls in this format
    tool_names: frozenset[str] = frozenset()
    forced: bool = False  # a grammar forces the calls (the answer starts with them)
    reasoning_format: ReasoningFormat | None = None
    stream_reasoning: bool = True

    def output(self, prompt_tail: str = "", *, eager: bool) -> ChatOutput:
        """A fresh parser of the answer (eager: streaming, calls emitted as they come)."""
        reasoning = None
        if self.reasoning_format is not None:
            # a forced grammar starts the answer with the calls: not inside a thinking part
            inside = False if self.forced else starts_in_reasoning(self.reasoning_format, prompt_tail)
            reasoning = ReasoningParser(self.reasoning_format, in_reasoning=inside,
                                        stream_reasoning=self.stream_reasoning or not eager)
        tools = None
        if self.tool_format is not None:
            tools = ToolCallParser(self.tool_format, set(self.tool_names), eager=eager)
        return ChatOutput(reasoning, tools)


async def plan_chat(cfg: ServerConfig, body: Any, params: dict[str, Any]) -> ChatPlan:
    """Check tools/tool_choice against the server's parsers; add the forcing grammar to `params`
    (as `ebnf`) for tool_choice required or a named function. APIError(400) naming the field."""
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
    named = tool_name_choice(choice)
    forced = choice == "required" or named is not None
    functions = _functions(body)
    if forced and not functions:
        raise APIError(400, "tool_choice requires tools, and the request has none", param="tool_choice")
    if named is not None and named not in {f["name"] for f in functions}:
        raise APIError(400, f"tool_choice names the function {named!r}, which is not in tools", param="tool_choice")
    fmt = TOOL_CALL_FORMATS.get(cfg.tool_call_parser) if cfg.tool_call_parser else None
    if forced and fmt is None:
        raise APIError(400, "tool_choice required or a named function needs a server started with "
                            "--tool-call-parser (the model's tool-call format)", param="tool_choice")
    if forced:
        assert fmt is not None
        clash = [k for k in GRAMMAR_PARAMS if params.get(k) is not None]
        if clash:
            raise APIError(400, f"tool_choice {json.dumps(choice) if isinstance(choice, str) else 'function'} "
                                f"constrains the answer and so does {clash[0]}: give one of them", param="tool_choice")
        tools_json = json.dumps(functions, sort_keys=True)
        try:
            # xgrammar's schema conversion: milliseconds, but off the event loop all the same
            params["ebnf"] = await asyncio.to_thread(_ebnf, fmt.name, tools_json, named, body.parallel_tool_calls)
        except ToolGrammarError as e:
            raise APIError(400, str(e), param="tools") from None
    use_tools = fmt is not None and choice != "none" and bool(functions)
    names = frozenset(f["name"] for f in functions if named is None or f["name"] == named)
    reasoning = None
    if cfg.reasoning_parser and body.separate_reasoning:
        reasoning = REASONING_FORMATS[cfg.reasoning_parser]
    return ChatPlan(tool_format=fmt if use_tools else None, tool_names=names, forced=forced,
                    reasoning_format=reasoning, stream_reasoning=body.stream_reasoning)


def prompt_tail(tokenizer: Any, ids: list[int]) -> str:
    """The prompt's last few tokens as text (special tokens kept): does it open a thinking part?"""
    if tokenizer is None or not ids:
        return ""
    return tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
