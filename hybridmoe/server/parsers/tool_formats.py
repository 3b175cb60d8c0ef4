"""Tool-call formats (`--tool-call-parser`, SGLang's names): the tags around each call and how a
call's body splits into a function name and its JSON arguments.

  qwen25      Qwen2.5/Qwen3 (hermes style):
                <tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>
              one block per call, separated by newlines ("parameters" accepted for "arguments");
              a block may also hold a JSON array of such objects: one call per element, in order
              (`[]`: no call). SGLang's `hermes` and `qwen` are this format.
  deepseekv3  DeepSeek-V3:
                <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>
                ...<｜tool▁calls▁end｜>
  kimi_k2     Kimi-K2:
                <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}
                <|tool_call_end|>...<|tool_calls_section_end|>
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    call_begin: str
    call_end: str
    header: re.Pattern[str]  # matches a call body's start up to its arguments; group "name"
    trailer: re.Pattern[str]  # what follows the arguments inside a call body (anchored at the end)
    trailer_chars: str  # characters a trailer is made of: held back while streaming the arguments
    section_begin: str | None = None  # the calls' section, around all calls
    section_end: str | None = None
    # a call block's body may be a JSON array of call bodies (each one as `header`...`trailer` reads a
    # call): several calls in one block, read once the block closes (tool_calls.py)
    arrays: bool = False

    @property
    def opening(self) -> str:
        """The tag that starts tool calling in an output."""
        return self.section_begin or self.call_begin

    def tags(self) -> tuple[str, ...]:
        return tuple(t for t in (self.section_begin, self.section_end, self.call_begin, self.call_end) if t)

    def call_id(self, name: str, index: int) -> str | None:
        """The call's id where the format defines one (Kimi's `functions.NAME:IDX`); None: a random id."""
        return f"functions.{name}:{index}" if self.name == "kimi_k2" else None


_NAME = r"(?P<name>[A-Za-z0-9_.\-]{1,64})"

QWEN25 = ToolCallFormat(
    "qwen25", "<tool_call>", "</tool_call>",
    header=re.compile(r'\s*\{\s*"name"\s*:\s*"' + _NAME + r'"\s*,\s*"(?:arguments|parameters)"\s*:\s*'),
    trailer=re.compile(r"\s*\}\s*\Z"), trailer_chars=" \t\r\n}", arrays=True)

DEEPSEEKV3 = ToolCallFormat(
    "deepseekv3", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
    header=re.compile(r"\s*function\s*<｜tool▁sep｜>\s*" + _NAME + r"\s*\n```(?:json)?\s*\n"),
    trailer=re.compile(r"\s*```\s*\Z"), trailer_chars=" \t\r\n`",
    section_begin="<｜tool▁calls▁begin｜>", section_end="<｜tool▁calls▁end｜>")

KIMI_K2 = ToolCallFormat(
    "kimi_k2", "<|tool_call_begin|>", "<|tool_call_end|>",
    header=re.compile(r"\s*(?:functions\.)?(?P<name>[A-Za-z0-9_.\-]{1,64}?):\d+\s*<\|tool_call_argument_begin\|>\s*"),
    trailer=re.compile(r"\s*\Z"), trailer_chars=" \t\r\n",
    section_begin="<|tool_calls_section_begin|>", section_end="<|tool_calls_section_end|>")

TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (QWEN25, DEEPSEEKV3, KIMI_K2)}
