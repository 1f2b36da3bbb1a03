"""Quality gate: the published advice as a check. Hide a fact in a long document, ask for it with
an empty cache (salted: a true cold read), ask again with the document cached; at temperature 0
the answers must be identical, and the warm ask must be served >= 95% from the cache."""

from __future__ import annotations

import time
import uuid
from typing import Any

from ikcode.doctor.client import error_message, hit_rate
from ikcode.doctor.context import FULL, DoctorContext
from ikcode.doctor.needle import needle_document, new_salt, request_body
from ikcode.doctor.result import CheckResult, failed, passed, warned

NAME = "quality_gate"
MIN_WARM_HIT = 0.95
MIN_WARM_HIT_FLOOR = 0.5
QUICK_TOKENS = 2500  # a few seconds of CPU prefill: quick mode stays well under a minute
MAX_TOKENS = 200_000
CHARS_PER_TOKEN_GUESS = 4.0
RELEASE_PAUSE_S = 0.3  # engines commit a prefix when they release the sequence, just after the reply


# A warm read can miss up to about one block at the end, plus whatever the engine must recompute
# before resuming (DeepInfer: 140 tokens, 128-token blocks). A document of this many blocks keeps
# that margin under the 5% the gate allows.
BLOCKS_PER_DOCUMENT = 50


# A block size for an endpoint that does not report one (an upstream front): the largest an engine
# behind it is likely to cache by (DeepInfer's 128-token pages), so the documents are long enough.
UNKNOWN_BLOCK_SIZE = 128
# The salted cold ask may share only the chat template's first tokens with anything cached.
MAX_COLD_HIT = 0.5


def min_warm_hit(prompt_tokens: int, block_size: int) -> float:
    """MIN_WARM_HIT, or less for a document too short for it: up to two blocks (the partial last
    one, and what the engine recomputes before resuming) may miss, whatever the window allows."""
    if prompt_tokens <= 0:
        return MIN_WARM_HIT
    # Never below half: with big blocks and a small window the margin went to 0 or below, and a
    # warm ask that read nothing from the cache passed.
    return max(MIN_WARM_HIT_FLOOR, min(MIN_WARM_HIT, 1.0 - 2 * block_size / prompt_tokens))


def document_sizes(window: int, mode: str, block_size: int = 16) -> list[int]:
    """Target prompt sizes in tokens: one of a few thousand (quick), several up to 200K (full)."""
    room = min(window - 512, MAX_TOKENS)
    if mode != FULL:
        quick = max(QUICK_TOKENS, BLOCKS_PER_DOCUMENT * block_size)
        return [max(256, min(quick, int(window * 0.45)))]
    fractions = (0.25, 0.5, 0.9) if room <= 32_768 else (0.1, 0.25, 0.5, 0.75, 1.0)
    return [max(256, int(room * f)) for f in fractions]


def _chars_per_token(ctx: DoctorContext, model: str) -> float:
    sample = needle_document(4000, "sizing")
    counted = ctx.client.post(
        "/v1/messages/count_tokens",
        {k: v for k, v in request_body(model, sample).items() if k in ("model", "messages")},
    )
    tokens = counted.json().get("input_tokens") if counted.status_code == 200 else None
    return len(sample.text) / tokens if isinstance(tokens, int) and tokens > 0 else CHARS_PER_TOKEN_GUESS


def ask_twice(ctx: DoctorContext, model: str, target_tokens: int, chars_per_token: float) -> dict[str, Any]:
    document = needle_document(int(target_tokens * chars_per_token), new_salt())
    body = request_body(model, document)
    session = f"ikcode-doctor-{uuid.uuid4().hex[:12]}"
    cold = ctx.client.stream_message(body, session)
    time.sleep(RELEASE_PAUSE_S)
    warm = ctx.client.stream_message(body, session) if cold.status == 200 and cold.error is None else None
    usage = cold.usage
    return {
        "target_tokens": target_tokens,
        "prompt_tokens": sum(
            int(usage.get(k) or 0)
            for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
        ),
        "passphrase": document.passphrase,
        "cold_answer": cold.text.strip(),
        "warm_answer": warm.text.strip() if warm else None,
        "match": warm is not None and warm.answer == cold.answer,
        "empty": not cold.answer,  # nothing streamed: cold = warm would compare nothing
        "found": document.passphrase in cold.text,
        "cold_hit_rate": hit_rate(cold.usage),
        "warm_hit_rate": hit_rate(warm.usage) if warm else None,
        "cold_ttft_s": cold.ttft_s,
        "warm_ttft_s": warm.ttft_s if warm else None,
        "error": _error(cold) or (_error(warm) if warm else None),
        "session_id": session,
    }


def _error(result: Any) -> str | None:
    if result.status != 200 or result.error is not None:
        return f"HTTP {result.status}: {error_message(result.error) or 'stream error'}"
    return None


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _secs(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} s"


def check_quality_gate(ctx: DoctorContext) -> CheckResult:
    model = ctx.model_id or ctx.profile.served_model
    window = ctx.context_window or ctx.profile.context_window
    ratio = _chars_per_token(ctx, model)
    block = int((ctx.health or {}).get("block_size") or UNKNOWN_BLOCK_SIZE)
    docs = [ask_twice(ctx, model, size, ratio) for size in document_sizes(window, ctx.mode, block)]
    for doc in docs:
        doc["min_warm_hit_rate"] = round(min_warm_hit(doc["prompt_tokens"], block), 4)
    data: dict[str, Any] = {"documents": docs, "min_warm_hit_rate": MIN_WARM_HIT, "block_size": block}
    problems = []
    for doc in docs:
        size = f"{doc['prompt_tokens']:,}-token document"
        want = doc["min_warm_hit_rate"]
        if doc["error"]:
            problems.append(f"{size}: {doc['error']}")
        elif doc["warm_hit_rate"] is None:
            problems.append(f"{size}: the usage fields carry no cache figures")
        elif doc["warm_hit_rate"] < want:
            problems.append(
                f"{size}: the warm ask read only {_pct(doc['warm_hit_rate'])} from cache "
                f"(want >= {want:.1%}): a silent cache miss"
            )
        if not doc["error"] and (doc["cold_hit_rate"] or 0.0) > MAX_COLD_HIT:
            # Its document opens with a fresh salt: nothing cached can share more than the
            # template's first tokens. A hit here is another prompt's KV, and cold = warm then
            # compares one wrong answer with itself.
            problems.append(
                f"{size}: the cold ask, a document never sent before, read {_pct(doc['cold_hit_rate'])} "
                "from cache: the cache serves blocks of other prompts (its keys miss the tokens or the salt)"
            )
        if not doc["error"] and not doc["match"]:
            problems.append(
                f"{size}: cold answer {doc['cold_answer']!r} != warm answer {doc['warm_answer']!r} "
                "at temperature 0"
            )
    empty = [d for d in docs if not d["error"] and d["empty"]]
    if empty:
        return warned(
            NAME,
            f"the model streamed nothing for {len(empty)} of {len(docs)} document(s) (no text, thinking "
            "or tool call): cold = warm compared two empty answers and proves nothing",
            "check the served model answers a plain question (doctor asks with max_tokens 16)",
            **data,
        )
    first = docs[0]
    # A small model may miss the needle: the gate is that the cold and warm answers are the same.
    needle = "needle found" if first["found"] else "the model missed the needle; what counts is cold = warm"
    summary = (
        f"{len(docs)} document(s) up to {max(d['prompt_tokens'] for d in docs):,} tokens: answer "
        f"{first['cold_answer'][:40]!r} ({needle}), "
        f"match {all(d['match'] for d in docs)}, warm hit {_pct(first['warm_hit_rate'])}, "
        f"TTFT cold {_secs(first['cold_ttft_s'])} / warm {_secs(first['warm_ttft_s'])}"
    )
    if problems:
        fix = (
            "cache entries must be committed when the engine releases a sequence, not at its final token; "
            "check the engine's prefix caching is on and its cache holds a whole document"
        )
        if any("!=" in p for p in problems):
            fix = (
                "make the engine deterministic at temperature 0 (batch-invariant kernels) and check "
                "cached KV equals recomputed KV; " + fix
            )
        return failed(NAME, "; ".join(problems), fix, **data)
    slow = [
        d
        for d in docs
        if d["cold_ttft_s"]
        and d["warm_ttft_s"]
        and d["cold_ttft_s"] > 1.0
        and d["warm_ttft_s"] > 0.8 * d["cold_ttft_s"]
    ]
    if slow:
        return warned(
            NAME,
            summary + "; but warm TTFT is not faster than cold",
            "the cache reports hits but the engine recomputes: check the engine reuses cached KV",
            **data,
        )
    return passed(NAME, summary, **data)
