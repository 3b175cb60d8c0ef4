"""Chat templates rendered in a sandboxed Jinja environment.

`ImmutableSandboxedEnvironment`: a template can neither reach Python internals (`__class__`,
`__globals__`, ...) nor mutate what it is given (`messages.append`, `dict.update`); its loops are
bounded by jinja's range limit. Time and memory are bounded by where it runs: a worker process
(workers.py) that is killed past --chat-template-timeout.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The messages cannot be rendered with the template (the message says why)."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers' own environment knows this tag (it marks the assistant's
    part for assistant-token masks) and templates on the Hub use it; here it renders its body in a scope of its
    own, as transformers' does. Without it such a template was an "unknown tag" error on every chat request."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> Any:
    """The compiled template (cached by source); jinja2's TemplateSyntaxError (with its line) when it is not valid
    Jinja, RecursionError when nested past the parser's depth. The startup checks compile the model's template
    through here: what passes them is what the chat routes render."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def model_template(tokenizer: Any) -> str | None:
    """The tokenizer's chat template source (the default one when it has several)."""
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):
        tpl = tpl.get("default") or next(iter(tpl.values()), None)
    return tpl or None


def special_tokens(tokenizer: Any) -> dict[str, str]:
    """bos_token, eos_token, ... as strings, the variables templates expect."""
    out = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, str):
            out[name] = value
    return out


def render_chat(source: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                continue_final_message: bool, variables: dict[str, Any]) -> str:
    """The prompt text; ChatTemplateError when the template fails or refuses the messages.

    variables: the tokenizer's special tokens and the client's chat_template_kwargs; they cannot
    replace `messages` or `add_generation_prompt`.
    """
    try:
        template = compile_template(source)
        text = template.render(**{**variables, "messages": messages, "add_generation_prompt": add_generation_prompt})
    except (TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError, RecursionError,
            OverflowError) as e:
        raise ChatTemplateError(f"{type(e).__name__}: {e}") from e
    if continue_final_message:
        final = messages[-1].get("content") if messages else None
        if not isinstance(final, str) or not final.strip() or final.strip() not in text:
            raise ChatTemplateError("continue_final_message: the rendered prompt does not contain the final "
                                    "message's content")
        # end the prompt right after the final message, so the model continues it
        cut = text.rindex(final) + len(final) if final in text else text.rindex(final.strip()) + len(final.strip())
        text = text[:cut]
    return text
