"""Reasoning parsers (`--reasoning-parser`, SGLang's names): split a model's thinking part out of its
answer, as a whole or streamed in chunks of any size.

Formats (the models' own tags):
  qwen3        `<think>` reasoning `</think>` answer; `<think>` optional (Qwen3 with enable_thinking
               false answers without it). A `<tool_call>` before `</think>` also ends the reasoning.
  qwen3-thinking  qwen3's tags, but the output starts inside the thinking part (Qwen3 thinking-only
               models, whose template opens it in the prompt): everything before `</think>` (or a
               `<tool_call>`) is reasoning; a leading `<think>` is dropped. SGLang's force_reasoning.
  deepseek-r1  DeepSeek-R1's template opens the thinking part in the prompt, so the output starts
               inside it: everything before `</think>` is reasoning (a leading `<think>`, as
               R1-0528 may emit, is dropped). SGLang's force_reasoning.
  kimi         Kimi's `◁think▷` reasoning `◁/think▷` answer.
  kimi_k2      `<think>` ... `</think>`; `<|tool_calls_section_begin|>` also ends the reasoning.
A model whose prompt already ends inside an open thinking part (a template that appends
`<think>\n`) starts in the reasoning with any parser: see `starts_in_reasoning`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridmoe.server.parsers.text import Trimmed, partial_tail


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    force: bool = False  # the output starts inside the reasoning
    tool_start: str | None = None  # a tool call's opening tag, which ends the reasoning implicitly


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat("<think>", "</think>", tool_start="<tool_call>"),
    "qwen3-thinking": ReasoningFormat("<think>", "</think>", force=True, tool_start="<tool_call>"),
    "deepseek-r1": ReasoningFormat("<think>", "</think>", force=True),
    "kimi": ReasoningFormat("◁think▷", "◁/think▷"),
    "kimi_k2": ReasoningFormat("<think>", "</think>", tool_start="<|tool_calls_section_begin|>"),
}


def starts_in_reasoning(fmt: ReasoningFormat, prompt_tail: str) -> bool:
    """Whether generation starts inside the thinking part: the format says so, or the prompt's end
    opened a thinking part that it did not close."""
    if fmt.force:
        return True
    i = prompt_tail.rfind(fmt.start)
    return i >= 0 and fmt.end not in prompt_tail[i:]


class ReasoningParser:
    """Streaming splitter: feed(chunk) -> (reasoning, answer) pieces; finish() flushes.

    The pieces of each kind concatenate to the same strings whatever the chunking: reasoning and
    answer with their surrounding whitespace trimmed. stream_reasoning=False holds the reasoning
    back until it ends (SGLang's stream_reasoning).
    """

    def __init__(self, fmt: ReasoningFormat, *, in_reasoning: bool | None = None, stream_reasoning: bool = True):
        self.fmt = fmt
        # None: decided by the first non-whitespace output (does it open with the start tag?)
        self.state = "reasoning" if (fmt.force if in_reasoning is None else in_reasoning) else "undecided"
        self.stream_reasoning = stream_reasoning
        self.buf = ""
        self.held_reasoning = ""
        self.reasoning_out = Trimmed()
        self.answer_out = Trimmed()
        self.skip_start = True  # a start tag at the very beginning of the reasoning is dropped

    def _reasoning(self, text: str) -> str:
        out = self.reasoning_out.feed(text)
        if self.stream_reasoning:
            return out
        self.held_reasoning += out
        return ""

    def _end_reasoning(self) -> str:
        self.state = "answer"
        out, self.held_reasoning = self.held_reasoning, ""
        return out

    def feed(self, chunk: str) -> tuple[str, str]:
        """(reasoning, answer) text of this chunk that can be shown now."""
        self.buf += chunk
        reasoning, answer = "", ""
        fmt = self.fmt
        if self.state == "undecided":
            head = self.buf.lstrip()
            if not head or (fmt.start.startswith(head) and head != fmt.start):
                return "", ""  # maybe the start tag: wait
            if head.startswith(fmt.start):
                self.state, self.buf = "reasoning", head
            else:
                self.state = "answer"
        if self.state == "reasoning":
            if self.skip_start:
                head = self.buf.lstrip()
                if fmt.start.startswith(head) and head != fmt.start:
                    return "", ""
                if head.startswith(fmt.start):
                    self.buf = head[len(fmt.start):]
                self.skip_start = False
            tags = (fmt.end,) + ((fmt.tool_start,) if fmt.tool_start else ())
            ends = [(i, t) for t in tags if (i := self.buf.find(t)) >= 0]
            if ends:
                i, tag = min(ends)
                reasoning = self._reasoning(self.buf[:i])
                reasoning += self._end_reasoning()
                # the end tag is dropped; a tool call's start tag belongs to the answer
                self.buf = self.buf[i + len(tag):] if tag == fmt.end else self.buf[i:]
            else:
                keep = partial_tail(self.buf, tags)
                reasoning = self._reasoning(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return reasoning, ""
        answer = self.answer_out.feed(self.buf)
        self.buf = ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What is left at the end of the output (a reasoning cut short stays reasoning)."""
        rest, self.buf = self.buf, ""
        if self.state == "answer":
            return "", self.answer_out.feed(rest)
        if self.state == "undecided":  # only whitespace or a start-tag prefix: plain answer text
            self.state = "answer"
            return "", self.answer_out.feed(rest)
        reasoning = self._reasoning(rest) + self.held_reasoning
        self.held_reasoning = ""
        return reasoning, ""

    def parse(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) of a whole output."""
        r1, a1 = self.feed(text)
        r2, a2 = self.finish()
        return r1 + r2, a1 + a2
