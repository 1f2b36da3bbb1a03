"""Prompt text -> token ids, with the tool format's markers under control.

A turn's text is tokenized with special tokens off, except the format's own markers (and think
tags) where its vocabulary holds them as tokens; client text has those markers wrapped in guard
characters first (marker_guard.py), so that a file holding `<|end|><|start|>system<|message|>`
stays characters. Role markers around a turn are tokenized with special tokens on. Every id
comes from one shared table (`intern`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ikcode.gateway.chat_format import TokenizerLike
from ikcode.gateway.content_text import Guards, unguarded
from ikcode.gateway.marker_guard import GUARD_OPEN, GUARDED, GUARDS, alternation, wrapped


class PromptEncoder:
    def __init__(self, tokenizer: TokenizerLike, markers: tuple[str, ...]):
        """markers: strings kept as their tokens in a turn's text (think tags, the format's)."""
        self.tokenizer = tokenizer
        # Guard against tokenizers that add a BOS on every call: strip it per segment.
        self._auto = len(tokenizer.encode("", allow_special=False))
        # One shared int object per token id: a 450K-token prompt is then built by copying
        # pointers to a compact table instead of touching 450K scattered int objects.
        vocab = getattr(tokenizer, "vocab_size", None)
        has_vocab = isinstance(vocab, int) and vocab > 0
        self._interned: list[int] | None = list(range(vocab)) if has_vocab else None
        self.tag_ids = {t: i for t in markers if (i := tokenizer.token_to_id(t)) is not None}
        self.specials: dict[str, int] = getattr(tokenizer, "special_token_ids", None) or {}
        self._tag_re = alternation(self.tag_ids)
        # A tool's name lands inside role markers (encoded with special tokens allowed): every
        # special token string in it is guarded, not only the format's markers.
        self._special_re = alternation(set(self.specials) | set(self.tag_ids))
        # A piece of text split out of a prompt: a guarded span, a tag, or the text between them.
        tag_alternatives = "".join(f"|{re.escape(t)}" for t in self.tag_ids)
        self._piece_re = re.compile(f"({GUARDED.pattern}{tag_alternatives})")
        self._tag_starts = {t[0] for t in self.tag_ids}
        self.guard: Callable[[str], str] = self._guard if self._tag_re is not None else unguarded
        self.guards = Guards(self.guard, self._guard_name)

    def encode(self, text: str, allow_special: bool) -> list[int]:
        ids = self.tokenizer.encode(text, allow_special=allow_special)
        return self.intern(ids[self._auto :] if self._auto else ids)

    def intern(self, ids: list[int]) -> list[int]:
        table = self._interned
        if table is None:
            return ids
        try:
            return [table[i] for i in ids]
        except IndexError:  # an id past the vocabulary size: keep the ids as they are
            return ids

    def _guard(self, text: str) -> str:
        """Client text (a user's words, a file a tool read): the tool format's markers in it are
        wrapped so that they are tokenized as the text they are, never as the control tokens the
        format's own markup uses (a file holding `<|end|><|start|>system<|message|>` would
        otherwise forge a system turn). Guard characters the client sent are replaced."""
        assert self._tag_re is not None
        if not any(c in text for c in self._tag_starts | GUARDS):
            return text
        return wrapped(self._tag_re, text)

    def _guard_name(self, name: str) -> str:
        return name if self._special_re is None else wrapped(self._special_re, name)

    def plain(self, text: str) -> list[int]:
        """A turn's text: the format's markers in it are its control tokens, guarded spans and
        every other special-token string stay text (no role injection)."""
        return self._pieces(text, allow_special=False)

    def framed(self, text: str) -> list[int]:
        """Role markers around a turn (special tokens), with guarded client text inside them."""
        return self._pieces(text, allow_special=True)

    def _pieces(self, text: str, allow_special: bool) -> list[int]:
        if not text:
            return []
        # Guarded spans come from names too (_guard_name), with or without tags in the vocabulary.
        if not any(c in text for c in self._tag_starts | GUARDS):
            return self.encode(text, allow_special)
        ids: list[int] = []
        for piece in self._piece_re.split(text):
            tag = self.tag_ids.get(piece)
            if tag is not None:
                ids.append(tag)
            elif piece.startswith(GUARD_OPEN):
                ids.extend(self.encode(piece[1:-1], False))
            elif piece:
                ids.extend(self.encode(piece, allow_special))
        return ids
