"""Streaming detokenization: token ids in, text deltas out, never half a UTF-8 character.

Byte-level BPE tokens can end inside a multi-byte character (an emoji is often 2-4 tokens), and
sentencepiece decoders drop a leading space when decoding a lone token. So text is never decoded
token by token: we decode a small window that starts a little before the new tokens and emit
only what the window adds beyond its already-emitted part, holding back while the text ends in
U+FFFD (an incomplete character). vLLM's `detokenize_incrementally` works the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_INCOMPLETE = "\ufffd"


class IncrementalDecoder:
    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        context_ids: Sequence[int] = (),
    ):
        """`context_ids`: the last few prompt ids, so the first emitted token decodes in context
        (their text is not emitted)."""
        self._decode = decode
        self._ids: list[int] = list(context_ids)
        self._prefix_offset = 0  # window start: decoded again only as context
        self._read_offset = len(self._ids)  # everything before this has been emitted

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    def feed(self, ids: int | Sequence[int]) -> str:
        """Add generated ids; return the text they complete (may be "" while a character is open)."""
        if isinstance(ids, int):
            self._ids.append(ids)
        else:
            self._ids.extend(ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """End of stream: emit whatever is held back, incomplete characters as U+FFFD."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        emitted = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        if not final and (len(text) <= len(emitted) or text.endswith(_INCOMPLETE)):
            return ""
        delta = text[len(emitted) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta
