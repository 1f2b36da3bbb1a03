"""DeepInfer's LLMEngine with the cache commit in finalize_seq."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def _commit(engine: Any, seq: Any) -> None:
    """The cache work of finalize_seq. A failure must not keep DeepInfer from freeing the sequence,
    and must not pass silently either (a cache that never fills looks like a working server): it
    is counted (cache_stats' commit_failures, which `ikcode doctor` fails on) and logged."""
    rank = getattr(engine, "ikcode_rank", None)
    if rank is None:
        return
    try:
        rank.on_finalize(seq)
    except Exception as exc:
        rank.commit_failures += 1
        log.error(
            "rank %s: cache commit failed in finalize_seq (%s: %s); %d so far",
            rank.rank, type(exc).__name__, exc, rank.commit_failures, exc_info=True,
        )  # fmt: skip


def caching_engine_class(base: type) -> type:
    """DeepInfer's LLMEngine with finalize_seq overridden: cache work first, then the parent
    frees the sequence (facts: "Commit inside finalize_seq (override it, ...)")."""

    class CachingLLMEngine(base):  # type: ignore[misc, valid-type]
        ikcode_rank: Any = None  # the RankWorker driving this engine

        def finalize_seq(self, seq: Any) -> None:
            _commit(self, seq)
            super().finalize_seq(seq)

    return CachingLLMEngine


def make_caching_engine(base: type, args: Any) -> Any:
    """base.from_engine_args(args) as a CachingLLMEngine. Should from_engine_args build the base
    class itself rather than `cls`, the override is bound to the instance instead: the commit in
    finalize_seq must never be silently lost."""
    cls = caching_engine_class(base)
    engine = cls.from_engine_args(args)
    if not isinstance(engine, cls):
        parent: Callable[[Any], None] = engine.finalize_seq

        def finalize_seq(seq: Any) -> None:
            _commit(engine, seq)
            parent(seq)

        engine.finalize_seq = finalize_seq
    return engine
