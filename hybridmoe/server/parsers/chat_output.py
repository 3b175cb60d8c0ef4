"""A chat answer's text -> OpenAI message fields (reasoning_content, content, tool_calls), whole or
streamed as OpenAI deltas. The reasoning parser runs first; the tool-call parser reads its answer part.

Without any parser the text passes through unchanged; with one, content and reasoning are trimmed of
surrounding whitespace (the whitespace around tags), in both modes alike: a streamed answer's deltas
add up to the message a non-streamed request gets for the same text (for well-formed calls).
"""

from __future__ import annotations

from typing import Any

from hybridmoe.server.parsers.reasoning import ReasoningParser
from hybridmoe.server.parsers.text import Trimmed
from hybridmoe.server.parsers.tool_calls import ToolCallParser

Delta = dict[str, Any]


class ChatOutput:
    """feed(chunk) / finish() -> OpenAI delta dicts; message(text) for a whole answer."""

    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolCallParser | None = None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.content = Trimmed() if tools is not None else None
        self.num_calls = 0

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def _answer(self, text: str, end: bool) -> list[Delta]:
        if self.tools is None:
            return [{"content": text}] if text else []
        events = self.tools.feed(text) if text else []
        if end:
            events += self.tools.finish()
        out: list[Delta] = []
        assert self.content is not None
        for ev in events:
            if ev[0] == "content":
                piece = self.content.feed(ev[1])
                if piece:
                    out.append({"content": piece})
            elif ev[0] == "call":
                _, index, call_id, name = ev
                self.num_calls = max(self.num_calls, index + 1)
                out.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
            else:
                out.append({"tool_calls": [{"index": ev[1], "function": {"arguments": ev[2]}}]})
        return out

    def _step(self, chunk: str, end: bool) -> list[Delta]:
        if self.reasoning is None:
            return _merge(self._answer(chunk, end))
        reasoning, answer = self.reasoning.feed(chunk) if chunk else ("", "")
        if end:
            r2, a2 = self.reasoning.finish()
            reasoning, answer = reasoning + r2, answer + a2
        out = [{"reasoning_content": reasoning}] if reasoning else []
        return _merge(out + self._answer(answer, end))

    def feed(self, chunk: str) -> list[Delta]:
        """The deltas a new piece of the answer gives (partial tags held back)."""
        return self._step(chunk, end=False)

    def finish(self) -> list[Delta]:
        """The last deltas, at the end of the answer."""
        return self._step("", end=True)

    def message(self, text: str) -> dict[str, Any]:
        """The assistant message of a whole answer."""
        return assemble(self.feed(text) + self.finish())

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's finish_reason: "tool_calls" when the answer stopped after making calls."""
        return "tool_calls" if reason == "stop" and self.num_calls else reason


def _merge(deltas: list[Delta]) -> list[Delta]:
    """Adjacent text deltas of one kind joined (fewer events); argument pieces of one call too."""
    out: list[Delta] = []
    for d in deltas:
        prev = out[-1] if out else None
        if prev is not None and d.keys() == prev.keys() and "tool_calls" not in d:
            key = next(iter(d))
            prev[key] += d[key]
        elif (prev is not None and "tool_calls" in d and "tool_calls" in prev and "id" not in d["tool_calls"][0]
              and prev["tool_calls"][0]["index"] == d["tool_calls"][0]["index"]):
            prev["tool_calls"][0]["function"]["arguments"] += d["tool_calls"][0]["function"]["arguments"]
        else:
            out.append(d)
    return out


def assemble(deltas: list[Delta]) -> dict[str, Any]:
    """What a client builds from deltas: the assistant message (content null when there are calls
    and no text; reasoning_content null when there was no reasoning)."""
    content, reasoning = "", None
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        content += d.get("content", "")
        if "reasoning_content" in d:
            reasoning = (reasoning or "") + d["reasoning_content"]
        for c in d.get("tool_calls", []):
            if "id" in c:
                calls[c["index"]] = {"id": c["id"], "type": "function",
                                     "function": {"name": c["function"]["name"], "arguments": ""}}
            calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    tool_calls = [calls[i] for i in sorted(calls)] or None
    return {"role": "assistant", "content": content if content or not tool_calls else None,
            "reasoning_content": reasoning, "tool_calls": tool_calls}
