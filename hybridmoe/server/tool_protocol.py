"""Request models of tool calling and reasoning on /v1/chat/completions (strict, bounded): `tools`,
`tool_choice`, an assistant message's `tool_calls`, and `chat_template_kwargs`.

Bounds: the body size bounds everything already; these keep what reaches the chat template and the
grammar builder small and shallow (a JSON Schema nested thousands deep would exhaust recursion in
the template's tojson or the schema converter).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, StringConstraints
from pydantic_core import PydanticCustomError

from hybridmoe.server.strict import StrictModel

MAX_TOOLS = 128  # OpenAI's limit
MAX_TOOL_CALLS = 128  # in one assistant message of the history
MAX_SCHEMA_DEPTH = 32  # nesting of a function's `parameters` (objects and arrays)
MAX_SCHEMA_CHARS = 64 * 1024  # a function's `parameters`, as JSON
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KEY_CHARS = 128
MAX_TEMPLATE_VALUE_CHARS = 256 * 1024  # large enough for a client's chat_template (see state.py)
# the renderer sets these itself: from the request's messages, tools, and continue_final_message
RESERVED_TEMPLATE_KEYS = ("messages", "tools", "add_generation_prompt")

# OpenAI's function names: letters, digits, _ and -, at most 64; '.' too (namespaced names)
FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value (iterative: a deep value cannot exhaust the stack)."""
    best, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict | list):
            best = max(best, d)
            if d > MAX_SCHEMA_DEPTH:
                return d
            todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return best


def _schema(value: dict[str, Any]) -> dict[str, Any]:
    import json

    if _depth(value) > MAX_SCHEMA_DEPTH:
        raise PydanticCustomError("bad_value", "nested more than {n} levels deep", {"n": MAX_SCHEMA_DEPTH})
    if len(json.dumps(value)) > MAX_SCHEMA_CHARS:
        raise PydanticCustomError("bad_value", "longer than {n} characters as JSON", {"n": MAX_SCHEMA_CHARS})
    return value


Schema = Annotated[dict[str, Any], AfterValidator(_schema)]


class FunctionDef(StrictModel):
    name: FunctionName
    description: Annotated[str, Field(max_length=MAX_SCHEMA_CHARS)] | None = None
    parameters: Schema | None = None  # a JSON Schema of the arguments object; None: no arguments
    strict: bool | None = None  # arguments always follow the schema when the grammar is on


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDef


def _unique_names(tools: list[Tool]) -> list[Tool]:
    names = [t.function.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        # (ctx key "name" is errors._param's: it would be appended to the param; pydantic fills only {key}, not {key!r})
        raise PydanticCustomError("bad_value", "two tools are named {tool}", {"tool": repr(dup)})
    return tools


Tools = Annotated[list[Tool], Field(max_length=MAX_TOOLS), AfterValidator(_unique_names)]


class FunctionName_(StrictModel):
    name: FunctionName


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName_


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallIn(StrictModel):
    name: FunctionName
    arguments: Annotated[str, Field(max_length=MAX_SCHEMA_CHARS * 4)]  # a JSON object, as a string


class ToolCallIn(StrictModel):
    """A call the assistant made earlier in the conversation."""

    id: Annotated[str, Field(max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCallIn


ToolCalls = Annotated[list[ToolCallIn], Field(max_length=MAX_TOOL_CALLS)]

TemplateScalar = (Annotated[str, Field(max_length=MAX_TEMPLATE_VALUE_CHARS)] | bool | int
                  | Annotated[float, Field(allow_inf_nan=False)] | None)


def _template_kwargs(value: dict[str, Any]) -> dict[str, Any]:
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise PydanticCustomError("bad_value", "has {got} keys; at most {n}", {"got": len(value), "n": MAX_TEMPLATE_KWARGS})
    for k in value:
        if len(k) > MAX_TEMPLATE_KEY_CHARS or not k:
            raise PydanticCustomError("bad_value", "a key must have 1 to {n} characters", {"n": MAX_TEMPLATE_KEY_CHARS})
        if k in RESERVED_TEMPLATE_KEYS:
            raise PydanticCustomError("bad_value", "{key!r} is set by the server (from the request's messages, tools "
                                      "and continue_final_message); remove it", {"key": k})
    return value


TemplateKwargs = Annotated[dict[str, TemplateScalar], AfterValidator(_template_kwargs)]


def tool_name_choice(choice: Any) -> str | None:
    """The function a tool_choice names, else None."""
    return choice.function.name if isinstance(choice, NamedToolChoice) else None
