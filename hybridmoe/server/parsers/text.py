"""Small streaming text helpers shared by the parsers: partial-tag hold-back and whitespace trimming."""

from __future__ import annotations


def partial_tail(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `tags`: a stream holds
    it back, since the next chunk may complete the tag."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


class Trimmed:
    """A text stream with its leading and trailing whitespace removed, emitted as it comes.

    Trailing whitespace is held until non-whitespace follows (then it was inner whitespace) or the
    stream ends (then it is dropped): the streamed pieces concatenate to `whole.strip()`.
    """

    def __init__(self) -> None:
        self.started = False
        self.pending = ""

    def feed(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.pending + text
        body = text.rstrip()
        self.pending = text[len(body):]
        return body

    def finish(self) -> str:
        self.pending = ""
        return ""
