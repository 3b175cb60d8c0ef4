"""Streaming tool-call parser: a model's answer text -> content pieces and OpenAI tool calls.

One state machine for every format of tool_formats.py, fed the text in chunks of any size (a chunk
may end inside a tag: the partial tag is held back). It yields events:
  ("content", text)                 answer text outside the calls
  ("call", index, id, name)         a call begins (its name is known and its arguments have begun)
  ("args", index, text)             a piece of that call's arguments (JSON text)
A call whose body does not parse (not the format, a function not in `tools`, arguments that are not a
JSON object) is not a call: its whole text is content. With eager=False (a whole answer) a call is
emitted only once complete, so a malformed one is always left as content; with eager=True (streaming)
its name and arguments go out as they come, and a call found malformed after it began is closed as it
stands (its remaining text dropped): the client already holds its start.
Where the format allows it (`arrays`: hermes/qwen25), a block whose body is a JSON array gives one call
per element, in order, with the indices running on; the block is read once it closes (eager or not),
and all or nothing: an element that is not a well-formed call (read as a block's body is) leaves the
whole block as content, as a malformed call is; `[]` gives no call and no content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from hybridmoe.server.parsers.text import partial_tail
from hybridmoe.server.parsers.tool_formats import ToolCallFormat

Event = tuple[Any, ...]


def random_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def json_object(text: str) -> bool:
    """text is one JSON object (what a call's arguments must be)."""
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


_DECODER = json.JSONDecoder()
_JSON_WS = re.compile(r"[ \t\n\r]*")


def json_array_items(text: str) -> list[str] | None:
    """The texts of the elements when `text` is one JSON array (whitespace around it allowed), else None.

    The array's own level is walked here (no recursion); each element is read by json's parser, which
    recurses per nesting level: [[[...]]] too deep is a RecursionError, so not an array."""
    s = text.strip()
    if not s.startswith("["):
        return None
    i = _JSON_WS.match(s, 1).end()
    if i == len(s) - 1 and s[i] == "]":
        return []
    items: list[str] = []
    while True:
        try:
            _, end = _DECODER.raw_decode(s, i)
        except (ValueError, RecursionError):
            return None
        items.append(s[i:end])
        i = _JSON_WS.match(s, end).end()
        if s[i:i + 1] == ",":
            i = _JSON_WS.match(s, i + 1).end()
        elif i == len(s) - 1 and s[i] == "]":
            return items
        else:
            return None


class ToolCallParser:
    """feed(chunk) -> events; finish() -> the last events. See the module docstring."""

    def __init__(self, fmt: ToolCallFormat, tool_names: set[str] | None = None, *, eager: bool = True) -> None:
        self.fmt = fmt
        self.names = tool_names
        self.eager = eager
        self.state = "text"  # "text" | "section" (between calls of a section) | "call" (inside one)
        self.buf = ""
        self.body = ""  # the current call's body so far (after its begin tag)
        self.count = 0  # calls emitted
        self.started = False  # the current call has been emitted (eager)
        self.sent = ""  # the current call's arguments emitted so far
        self.broken = False  # the current call began and proved malformed
        # a section with no well-formed call is content, its tags too: the opening tag waits here
        self.section_tag = ""
        self.section_ok = False

    # ---------------------------------------------------------------- helpers

    def _header(self, body: str | None = None) -> tuple[str, str] | None:
        """(name, arguments so far) once the body's header is complete and names a known function
        (body: the current call's, unless given)."""
        body = self.body if body is None else body
        m = self.fmt.header.match(body)
        if m is None:
            return None
        name = m.group("name")
        if self.names is not None and name not in self.names:
            return None
        return name, body[m.end():].lstrip()

    def _call(self, body: str) -> tuple[str, str] | None:
        """(name, arguments) of a complete call body that is well-formed, else None."""
        head = self._header(body)
        if head is None:
            return None
        name, rest = head
        if not self.fmt.trailer.search(rest):
            return None
        rest = self.fmt.trailer.sub("", rest).strip()
        return (name, rest) if json_object(rest) else None

    def _array_calls(self) -> list[tuple[str, str]] | None:
        """The calls of a closed block whose body is a JSON array of call bodies (formats with `arrays`);
        None: not an array, or an element is not a well-formed call (then the block is malformed)."""
        if not self.fmt.arrays:
            return None
        items = json_array_items(self.body)
        if items is None:
            return None
        calls: list[tuple[str, str]] = []
        for item in items:
            call = self._call(item)
            if call is None:
                return None
            calls.append(call)
        return calls

    def _begin(self, name: str) -> list[Event]:
        index = self.count
        self.count += 1
        self.started, self.sent = True, ""
        self.section_ok, self.section_tag = True, ""
        return [("call", index, self.fmt.call_id(name, index) or random_call_id(), name)]

    def _progress(self) -> list[Event]:
        """Eager streaming: the call's name once known, then the arguments but a possible trailer."""
        if self.broken:
            return []
        head = self._header()
        if head is None:
            return []
        name, args = head
        if not self.started:
            if not args:
                return []
            if not args.startswith("{"):
                return []  # not a JSON object: it will be content (or is malformed)
            events = self._begin(name)
        else:
            events = []
        shown = args.rstrip(self.fmt.trailer_chars)
        if shown.startswith(self.sent) and len(shown) > len(self.sent):
            events.append(("args", self.count - 1, shown[len(self.sent):]))
            self.sent = shown
        return events

    def _complete(self, closed: bool = True) -> list[Event]:
        """The current call's end tag arrived (closed), or the output ended inside it."""
        raw = self.fmt.call_begin + self.body + (self.fmt.call_end if closed else "")
        call = self._call(self.body)
        events: list[Event] = []
        if self.started:
            args = call[1] if call is not None else None
            if args is not None and not self.broken and args.startswith(self.sent):
                if len(args) > len(self.sent):
                    events.append(("args", self.count - 1, args[len(self.sent):]))
            # else: malformed after it began: closed as it stands
        elif call is not None:
            events = self._begin(call[0]) + [("args", self.count - 1, call[1])]
        elif closed and (calls := self._array_calls()) is not None:
            for name, args in calls:  # [] : a well-formed block of no call
                events += self._begin(name) + [("args", self.count - 1, args)]
        else:
            events = [self._raw(raw)]
        self.body, self.started, self.sent, self.broken = "", False, "", False
        return events

    # ---------------------------------------------------------------- the machine

    def feed(self, chunk: str) -> list[Event]:
        self.buf += chunk
        events: list[Event] = []
        fmt = self.fmt
        while self.buf:
            if self.state == "text":
                found = [(i, t) for t in {fmt.opening, fmt.call_begin} if (i := self.buf.find(t)) >= 0]
                if not found:
                    keep = partial_tail(self.buf, (fmt.opening, fmt.call_begin))
                    if len(self.buf) > keep:
                        events.append(("content", self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                i, tag = min(found)
                if i:
                    events.append(("content", self.buf[:i]))
                self.buf = self.buf[i + len(tag):]
                self.state = "call" if tag == fmt.call_begin else "section"
                if self.state == "section":
                    self.section_tag, self.section_ok = tag, False
            elif self.state == "section":
                ends = [(i, t) for t in (fmt.call_begin, fmt.section_end) if t and (i := self.buf.find(t)) >= 0]
                if not ends:
                    keep = partial_tail(self.buf, (fmt.call_begin, fmt.section_end or fmt.call_begin))
                    self._section_text(self.buf[:len(self.buf) - keep], events)
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                i, tag = min(ends)
                self._section_text(self.buf[:i], events)
                self.buf = self.buf[i + len(tag):]
                self.state = "call" if tag == fmt.call_begin else "text"
                if tag != fmt.call_begin and not self.section_ok:
                    events.append(self._raw(tag))
            else:  # inside a call
                i = self.buf.find(fmt.call_end)
                if i < 0:
                    keep = partial_tail(self.buf, (fmt.call_end,))
                    self.body += self.buf[:len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    if self.eager:
                        events += self._progress()
                    break
                self.body += self.buf[:i]
                self.buf = self.buf[i + len(fmt.call_end):]
                if self.eager:
                    events += self._progress()
                events += self._complete()
                self.state = "section" if fmt.section_begin else "text"
        return events

    def _raw(self, text: str) -> Event:
        """Text of the format's that turned out not to be a call: content, after a pending section tag."""
        text, self.section_tag = self.section_tag + text, ""
        return ("content", text)

    def _section_text(self, text: str, events: list[Event]) -> None:
        # between the calls of a section only whitespace is expected; anything else is kept as content
        if text.strip():
            events.append(self._raw(text))

    def finish(self) -> list[Event]:
        """The output ended: a call cut short is malformed (content, unless it already began)."""
        events: list[Event] = []
        if self.state == "call":
            self.body += self.buf
            self.buf = ""
            if self.started:
                self.broken = True  # no end tag: closed as it stands
                events += self._complete(closed=False)
            else:
                events.append(self._raw(self.fmt.call_begin + self.body))
                self.body = ""
        elif self.buf:
            if self.state == "text":
                events.append(("content", self.buf))
            else:
                self._section_text(self.buf, events)
        if self.section_tag:
            events.append(self._raw(""))
        self.buf = ""
        self.state = "text"
        return events
