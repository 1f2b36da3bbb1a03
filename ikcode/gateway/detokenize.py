"""Token ids -> text deltas, one step at a time, without splitting a multi-byte character.

Decoding each token on its own breaks byte-level BPE (a character may span tokens, and a
leading space depends on the previous token), so each step decodes a short window that starts a
few tokens back and emits only what the window added once it no longer ends in a replacement
character (the same scheme as Hugging Face TGI's and vLLM's incremental detokenizers).
"""

from __future__ import annotations

from ikcode.gateway.chat_format import TokenizerLike


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TokenizerLike, skip_ids: tuple[int, ...] = ()):
        self.tokenizer = tokenizer
        self.skip_ids = frozenset(skip_ids)
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_ids: list[int]) -> str:
        self.ids.extend(t for t in token_ids if t not in self.skip_ids)
        if len(self.ids) == self._read_offset:
            return ""
        prefix_text = self.tokenizer.decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self.tokenizer.decode(self.ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back, less a character the reply ended in the middle of (cut
        by max_tokens: its bytes decode as U+FFFD, a character the model never wrote)."""
        if self._read_offset == len(self.ids):
            return ""
        prefix_text = self.tokenizer.decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self.tokenizer.decode(self.ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.ids)
        return new_text[len(prefix_text) :].rstrip("\ufffd")
