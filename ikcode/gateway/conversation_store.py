"""What the renderer remembers between requests: segment tokenizations and generated replies.

- Segment tokens, keyed by a digest of (role, content): a warm turn of a long conversation only
  tokenizes its new messages.
- Reply tokens, keyed by (digest of everything rendered before the reply, digest of the reply's
  content as the client echoes it back): the exact ids the model generated are reused, so the
  next request starts with exactly the tokens the engine already holds. Re-tokenizing the text
  of a reply (or the JSON of a tool call) would often give other ids and break the prefix there.
- Previous renders, keyed by conversation (the caller salts the key per user): the last few
  prompts of each conversation with the turns they came from, so that a warm turn compares its
  messages with them instead of digesting each one (see previous_render). A few per key, because
  one session can interleave conversations (a subagent beside its parent). Bounded like the
  session prefixes (4M tokens, 4,096 conversations), whose prompt lists they mostly share: what
  they hold beyond those (each request's parsed messages) is walked by every full garbage
  collection, which showed as a ~40 ms p95 in bench/gateway_overhead.py with 8M tokens of renders
  held. A render is charged its request's bytes where they are more than its tokens (an image is
  a few tokens and megabytes): counted in tokens, 50 conversations of a 1 MB screenshot each held
  50 MB as 9,050 tokens, and a client sending a new session id per request could fill memory.

All are bounded LRU maps (by tokens held); thread-safe because rendering runs on worker threads.
The bound is the gateway's `conversation_memory_tokens`: by default at least the tokens the engine's
KV memory holds, so that a conversation whose prefix is still cached is not tokenized whole again.
A forgotten 450K-token conversation costs ~2 s of one core on its next turn: with a 4M-token bound,
24 agents of 450K taking turns had every warm turn tokenized whole (bench/gateway_conversations.py;
100 agents, 45.6M tokens remembered, peaked at 3.0 GB of process memory).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

from ikcode.gateway.previous_render import PreviousRender

Key = bytes | tuple[bytes, bytes]

# The bound when the engine caches less (a laptop's embedded engine, an upstream endpoint): ~8
# conversations of 450K tokens.
DEFAULT_MEMORY_TOKENS = 4_000_000


def memory_tokens_for(setting: int | None, engine_kv_tokens: int) -> int:
    """The gateway's conversation memory in tokens: the setting, or at least what the engine's
    KV memory holds (a conversation the engine still caches is worth its render)."""
    if setting is not None:
        return setting
    return max(DEFAULT_MEMORY_TOKENS, engine_kv_tokens)


class _TokenLRU:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.tokens = 0
        self._items: OrderedDict[Key, list[int]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: Key) -> list[int] | None:
        ids = self._items.get(key)
        if ids is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return ids

    def put(self, key: Key, ids: list[int]) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self.tokens -= len(old)
        self._items[key] = ids
        self.tokens += len(ids)
        while self.tokens > self.max_tokens and len(self._items) > 1:
            _, evicted = self._items.popitem(last=False)
            self.tokens -= len(evicted)

    def __len__(self) -> int:
        return len(self._items)


class ConversationStore:
    def __init__(
        self,
        max_segment_tokens: int = 8_000_000,
        max_reply_tokens: int = 2_000_000,
        max_render_tokens: int = 4_000_000,
        max_renders_per_conversation: int = 4,
        max_conversations: int = 4096,
    ):
        self._lock = threading.Lock()
        self._segments = _TokenLRU(max_segment_tokens)
        self._replies = _TokenLRU(max_reply_tokens)
        self.max_render_tokens = max_render_tokens
        self.max_renders_per_conversation = max_renders_per_conversation
        self.max_conversations = max_conversations
        self._renders: OrderedDict[Hashable, list[PreviousRender]] = OrderedDict()
        self._render_tokens = 0

    @classmethod
    def sized(cls, memory_tokens: int) -> ConversationStore:
        """Renders bounded by memory_tokens, segment tokenizations by twice that (they also serve
        conversations whose render was dropped), replies by half."""
        return cls(
            max_segment_tokens=2 * memory_tokens,
            max_reply_tokens=max(1, memory_tokens // 2),
            max_render_tokens=memory_tokens,
        )

    def segment(self, key: bytes) -> list[int] | None:
        with self._lock:
            return self._segments.get(key)

    def put_segment(self, key: bytes, ids: list[int]) -> None:
        with self._lock:
            self._segments.put(key, ids)

    def reply(self, prefix_key: bytes, content_key: bytes) -> list[int] | None:
        with self._lock:
            return self._replies.get((prefix_key, content_key))

    def put_reply(self, prefix_key: bytes, content_key: bytes, ids: list[int]) -> None:
        with self._lock:
            self._replies.put((prefix_key, content_key), ids)

    def previous_renders(self, conversation: Hashable) -> list[PreviousRender]:
        with self._lock:
            renders = self._renders.get(conversation)
            if renders is None:
                return []
            self._renders.move_to_end(conversation)
            return list(renders)

    def put_render(
        self, conversation: Hashable, render: PreviousRender, replacing: PreviousRender | None = None
    ) -> None:
        """Keep `render` as the newest of the conversation's, in place of the one it continued."""
        with self._lock:
            renders = self._renders.pop(conversation, [])
            kept = [r for r in renders if r is not replacing]
            dropped = [r for r in renders if r is replacing]
            while len(kept) >= self.max_renders_per_conversation:
                dropped.append(kept.pop(0))
            kept.append(render)
            self._renders[conversation] = kept
            self._render_tokens += _weight(render) - sum(_weight(r) for r in dropped)
            while len(self._renders) > 1 and (
                self._render_tokens > self.max_render_tokens or len(self._renders) > self.max_conversations
            ):
                _, evicted = self._renders.popitem(last=False)
                self._render_tokens -= sum(_weight(r) for r in evicted)

    def render_stats(self) -> tuple[int, int]:
        """(conversations kept, tokens they are charged)."""
        with self._lock:
            return len(self._renders), self._render_tokens

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "segments": len(self._segments),
                "segment_tokens": self._segments.tokens,
                "segment_hits": self._segments.hits,
                "segment_misses": self._segments.misses,
                "replies": len(self._replies),
                "reply_tokens": self._replies.tokens,
                "reply_hits": self._replies.hits,
                "reply_misses": self._replies.misses,
            }


def _weight(render: PreviousRender) -> int:
    return render.weight or len(render.token_ids)
