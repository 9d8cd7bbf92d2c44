"""Turning a stream of token ids into a stream of text without splitting multi-byte characters."""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a short window of recent tokens each step (prefix/read offsets, as in TGI and vLLM)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def add(self, token_id: int) -> str:
        """The text this token completes ("" while it ends inside a multi-byte character)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if after.endswith(REPLACEMENT) or len(after) <= len(before):
            return ""
        new = after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new
        return new

    def flush(self) -> str:
        """Whatever text is still held back (an incomplete character at the end of the reply)."""
        held = self._decode(self.ids[self.prefix_offset:self.read_offset])
        rest = self._decode(self.ids[self.prefix_offset:])[len(held):]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += rest
        return rest
