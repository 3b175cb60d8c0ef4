"""Incremental detokenization: new text per step that never ends inside a multi-byte character."""

from __future__ import annotations

_HOLD = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to


class IncrementalDetokenizer:
    """Decodes a growing list of ids. Only a short window is re-decoded each step, so the cost
    per token is constant; text is released once it cannot change any more."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.kw = {"skip_special_tokens": skip_special_tokens,
                   "spaces_between_special_tokens": spaces_between_special_tokens}
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: decoding from here gives correct spacing
        self.read_offset = 0  # ids before this have been turned into released text
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        try:
            return self.tok.decode(ids, **self.kw)
        except TypeError:  # tokenizers without spaces_between_special_tokens
            return self.tok.decode(ids, skip_special_tokens=self.kw["skip_special_tokens"])

    def add(self, new_ids: list[int]) -> str:
        """Append ids; return the newly released text (possibly empty)."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith(_HOLD):
            new = full_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += new
            return new
        return ""

    def flush(self) -> str:
        """At the end: release whatever is held back (even an incomplete character)."""
        full = self._decode(self.ids)
        new = full[len(self.text):] if full.startswith(self.text) else ""
        self.text = full if full.startswith(self.text) else self.text
        self.read_offset = self.prefix_offset = len(self.ids)
        return new
