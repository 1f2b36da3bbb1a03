"""Chained block hashes of a prompt, resumed from the last prompt of the same conversation.

Hashing every block of a 450K-token prompt costs tens of milliseconds per request; the blocks of
the part the previous request already had are the same, so keep their hashes, keyed by the
rendered chain digest of a segment boundary (equal digest = equal token prefix), and hash only
from the last full block before that boundary onwards.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ikcode.cache import BlockHash, hash_blocks
from ikcode.gateway.prompt_chain import RenderedPrompt


class IncrementalBlockHasher:
    def __init__(self, block_size: int, max_entries: int = 256):
        self.block_size = block_size
        self.max_entries = max_entries
        self._chains: OrderedDict[tuple[bytes, str], list[BlockHash]] = OrderedDict()
        self._lock = threading.Lock()
        self.resumed_blocks = 0  # counters: how much hashing was skipped
        self.hashed_blocks = 0

    def hashes(self, rendered: RenderedPrompt, salt: str = "") -> list[BlockHash]:
        """hash_blocks(rendered.token_ids, block_size, salt), computed incrementally."""
        ids, bs = rendered.token_ids, self.block_size
        known: list[BlockHash] = []
        with self._lock:
            for digest, _ in reversed(rendered.boundaries):
                hit = self._chains.get((digest, salt))
                if hit is not None:
                    self._chains.move_to_end((digest, salt))
                    known = hit
                    break
        if known:  # the salt already lives in the chain: continue unsalted from the parent
            tail = hash_blocks(ids[len(known) * bs :], bs, parent=known[-1])
            full = known + tail
        else:
            tail = full = hash_blocks(ids, bs, salt)
        self.resumed_blocks += len(known)
        self.hashed_blocks += len(tail)
        if rendered.boundaries:  # remember up to the last boundary (what the next turn repeats)
            digest, offset = rendered.boundaries[-1]
            with self._lock:
                self._chains[(digest, salt)] = full[: offset // bs]
                while len(self._chains) > self.max_entries:
                    self._chains.popitem(last=False)
        return full
