"""Token ids -> text deltas, one step at a time, without splitting a multi-byte character.

Decoding each token on its own breaks byte-level BPE (a character may span tokens, and a
leading space depends on the previous token), so each step decodes a short window that starts a
few tokens back and emits only what the window added once it no longer ends in a character cut
in the middle (the same scheme as Hugging Face TGI's and vLLM's incremental detokenizers).

A cut character decodes as U+FFFD, and so does a U+FFFD the model really wrote. Where the
tokenizer gives the window's bytes (`token_bytes`: byte-level vocabularies) the two are told
apart, so a real one is neither held back nor dropped at the end; elsewhere a text ending in
U+FFFD is taken for a cut one.
"""

from __future__ import annotations

import codecs

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
        if len(new_text) > len(prefix_text) and self._ends_in_a_cut(new_text) is False:
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
        cut = self._ends_in_a_cut(new_text)
        self._prefix_offset = self._read_offset = len(self.ids)
        text = new_text[len(prefix_text) :]
        if cut is None:
            return text.rstrip("\ufffd")
        return text[:-1] if cut and text.endswith("\ufffd") else text

    def _ends_in_a_cut(self, window_text: str) -> bool | None:
        """Whether the held window's text ends in the U+FFFD of a character cut in the middle;
        None when it ends in U+FFFD and the tokenizer cannot say (then taken for a cut one)."""
        if not window_text.endswith("\ufffd"):
            return False
        token_bytes = getattr(self.tokenizer, "token_bytes", None)
        raw = token_bytes(self.ids[self._prefix_offset :]) if token_bytes is not None else None
        if raw is None:
            return None
        # An incremental decoder holds back an incomplete last character instead of replacing it.
        held = codecs.getincrementaldecoder("utf-8")("replace").decode(raw, final=False)
        return len(held) < len(raw.decode("utf-8", "replace"))
