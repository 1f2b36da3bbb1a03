"""A GPU-tier hit on DeepInfer's real engine core: the cached pages are copied into the sequence's
own blocks, and the cache's slots then point at those blocks (the cached copy goes back free), so
a warm turn holds its prefix once on the card, not twice. The answers, the cache entry and the
block counts must stay right through warm turns, aborts, preemption and eviction."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from ikcode.engines.base import EngineRequest, FinishReason, LifecycleKind, SamplingParams
from tests.deepinfer_build.cpu_runtime import ENV_STEP_SECONDS
from tests.deepinfer_build.harness import (
    assert_no_leaks,
    finished_normally,
    random_tokens,
    real_engine,
    run,
    wait_quiet,
)

pytestmark = pytest.mark.deepinfer

BLOCK = 128
KEEP = 140  # DEEPINFER_YOCO_PREFILL_KEEP_TOKENS: a hit stops KEEP tokens before the prompt's end


def submit(engine: Any, rid: str, prompt: list[int], max_tokens: int, session: str | None = None) -> Any:
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return engine.submit(EngineRequest(rid, list(prompt), sampling, session_id=session))


def cold_answers(tmp_path: Any, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    """Every prompt run with no cache at all (no priming pass, nothing committed before)."""
    answers = {}
    for name, prompt in prompts.items():
        engine = real_engine(tmp_path / f"cold-{name}", prime_min_tokens=0)
        try:
            answers[name], final = run(engine, name, prompt, max_tokens=max_tokens)
            assert finished_normally(final) and final.stats.cached_tokens_device == 0
        finally:
            engine.shutdown(drain_timeout_s=5)
    return answers


def prefix_copies(check: dict[str, Any], hit_blocks: int) -> int:
    """Blocks holding the hit prefix's KV on the card: the sequence's own copy (hit_blocks) plus
    the cached blocks for it that are not the sequence's own."""
    return hit_blocks + hit_blocks - check["blocks_pinned_in_sequences"]


def test_a_warm_turn_holds_its_prefix_once(tmp_path):
    history = random_tokens(3000, 21)
    engine = real_engine(tmp_path, blocks=96, prime_min_tokens=0)
    try:
        answer, final = run(engine, "t1", history, max_tokens=16, session="s")
        assert finished_normally(final)
        (idle,) = wait_quiet(engine)
        cached = (len(history) + 16 - 1) // BLOCK  # committed in finalize_seq: len - 1 valid tokens
        assert idle["blocks_pinned"] == cached == idle["blocks_total"] - idle["blocks_free"], idle
        prompt = history + answer + random_tokens(200, 22)
        hit = min(cached, (len(prompt) - KEEP) // BLOCK)
        # admission is told the allocation takes the prompt's blocks and nothing more
        placed = engine.placement(EngineRequest("t2", prompt, SamplingParams(), session_id="s"), [0])
        assert placed.kv_blocks == -(-len(prompt) // BLOCK)
        stream = submit(engine, "t2", prompt, max_tokens=300, session="s")
        it = iter(stream)
        first = next(it)  # the turn is running (decoding) from here on
        assert first.token_ids and not first.finished
        (mid,) = engine.check()
        (load,) = engine.rank_loads()  # pushed before the check's reply: the same moment
        assert load.kv_blocks_used == placed.kv_blocks == mid["blocks_in_sequences"], (load, mid)
        tokens = list(first.token_ids)
        for event in it:
            tokens += event.token_ids
        assert event.finished and finished_normally(event)
        assert event.stats.cached_tokens_device == hit * BLOCK, event.stats
        used = mid["blocks_total"] - mid["blocks_free"]
        copies = prefix_copies(mid, hit)
        print(
            f"mid-turn: {used} blocks in use ({mid['blocks_in_sequences']} in the sequence, "
            f"{mid['blocks_pinned']} pinned by the cache); the {hit}-block prefix occupies "
            f"{copies} blocks = {copies / hit:.2f}x"
        )
        # The blocks the hit was copied from went free after the copy (one step later) ...
        assert mid["blocks_copy_sources"] == 0, mid
        # ... so every block in use is the sequence's or the cache's, the hit prefix in both.
        assert copies == hit, f"the prefix occupies {copies} blocks for {hit} blocks of KV: {mid}"
        assert used == mid["blocks_in_sequences"] + mid["blocks_pinned"] - hit, mid
        # The cache still serves the prefix (its slots now point at the copy) and the answer is
        # what the same prompt gives cold.
        (after,) = wait_quiet(engine)
        assert_no_leaks([after])
        again, final3 = run(engine, "t3", prompt, max_tokens=300, session="s")
        assert final3.stats.cached_tokens_device >= hit * BLOCK, final3.stats
        assert again == tokens
        assert_no_leaks(wait_quiet(engine))
    finally:
        engine.shutdown(drain_timeout_s=5)
    assert cold_answers(tmp_path, {"t2": prompt}, 300)["t2"] == tokens


def test_aborted_warm_turns_leak_nothing_and_leave_the_prefix_served(tmp_path):
    """Warm turns of one conversation aborted at every stage: before admission, in a chunked
    prefill, admitted behind it (both copied the same cached prefix, so its slots end up pointing
    at the blocks of a sequence that was then aborted), while decoding, and after finishing. No
    block or state slot leaks, and the prefix is still served, right, to the next turn."""
    engine = real_engine(tmp_path, max_num_seqs=2, max_num_batched_tokens=512, blocks=128, prime_min_tokens=0)
    admitted = admissions(engine)
    try:
        history = random_tokens(3000, 31)
        answer, final = run(engine, "t1", history, max_tokens=16, session="s")
        assert finished_normally(final)
        wait_quiet(engine)
        base = history + answer
        hit = (len(base) - 1) // BLOCK
        # 1. before admission
        s = submit(engine, "queued", base + random_tokens(200, 1), 16, "s")
        s.abort()
        assert s.collect(60)[1].finish_reason is FinishReason.ABORT
        # 2. in a chunked prefill (1,500 new tokens, 512 per step); 3. admitted behind it
        running = submit(engine, "prefill", base + random_tokens(1500, 2), 400, "s")
        until(lambda: "prefill" in admitted)
        waiting = submit(engine, "waiting", base + random_tokens(1500, 3), 400, "s")
        until(lambda: "waiting" in admitted)
        waiting.abort()
        running.abort()
        for stream in (waiting, running):
            tokens, final = stream.collect(60)
            assert final.finish_reason is FinishReason.ABORT, final
        assert_no_leaks(wait_quiet(engine))
        # 4. decoding
        decoding = submit(engine, "decode", base + random_tokens(200, 4), 2000, "s")
        first = next(iter(decoding))
        assert first.token_ids and not first.finished
        decoding.abort()
        tokens, final = decoding.collect(60)
        assert final.finish_reason is FinishReason.ABORT and len(tokens) < 2000
        assert final.stats.cached_tokens_device == hit * BLOCK, final.stats
        # 5. finished, then a late abort
        done = submit(engine, "done", base + random_tokens(200, 5), 4, "s")
        tokens, final = done.collect(60)
        done.abort()
        assert finished_normally(final) and len(tokens) == 4
        assert_no_leaks(wait_quiet(engine))
        assert engine.cache_stats()["commit_failures"] == 0
        last = base + random_tokens(200, 6)
        warm, final = run(engine, "last", last, max_tokens=24, session="s")
        assert final.stats.cached_tokens_device >= hit * BLOCK, final.stats
        assert_no_leaks(wait_quiet(engine))
    finally:
        engine.shutdown(drain_timeout_s=5)
    assert cold_answers(tmp_path, {"last": last}, 24)["last"] == warm


def test_room_for_a_warm_turn_is_not_made_from_its_own_prefix(tmp_path):
    """A full GPU tier, the returning conversation's prefix the least recently used: the eviction
    that makes room for its allocation (the whole prompt, before the copy gives the hit's blocks
    back) takes the other conversation's blocks, not the prefix it is about to copy."""
    engine = real_engine(tmp_path, blocks=64, gpu_tier_fraction=0.6, prime_min_tokens=0)
    try:  # 63 usable blocks, 37 GPU-tier slots, 8 kept free for the prefill watermark
        history = random_tokens(3000, 61)
        answer, final = run(engine, "c1", history, max_tokens=16, session="c")  # 23 blocks, older
        assert finished_normally(final)
        run(engine, "d1", random_tokens(1800, 62), max_tokens=16, session="d")  # 14 blocks, newer
        (idle,) = wait_quiet(engine)
        assert idle["blocks_pinned"] == 37, idle
        warm_prompt = history + answer + random_tokens(200, 63)  # 26 blocks: 34 free needed, 26 are
        warm, final = run(engine, "c2", warm_prompt, max_tokens=16, session="c")
        assert final.stats.cached_tokens_device == (len(history) + 15) // BLOCK * BLOCK, final.stats
        assert_no_leaks(wait_quiet(engine))
    finally:
        engine.shutdown(drain_timeout_s=5)
    assert cold_answers(tmp_path, {"c2": warm_prompt}, 16)["c2"] == warm


def admissions(engine: Any) -> set[str]:
    """Ids of the requests the engine has admitted (allocated and handed to DeepInfer)."""
    admitted: set[str] = set()
    lock = threading.Lock()

    def listen(event: Any) -> None:
        if event.kind is LifecycleKind.ADMITTED:
            with lock:
                admitted.add(event.request_id)

    engine.add_listener(listen)
    return admitted


def until(predicate: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_a_preempted_warm_turn_leaks_nothing_and_leaves_the_prefix_served(tmp_path):
    """Two warm turns copy the same cached prefix (its slots end up pointing at the second one's
    blocks) and outgrow 40 KV blocks: DeepInfer preempts one and frees its blocks itself, without
    finalize_seq (scheduler.hpp:766-790). The blocks the cache points at stay pinned, nothing
    leaks, and the prefix still gives the cold answer."""
    engine = real_engine(tmp_path, blocks=40, max_model_len=4000, gpu_tier_fraction=0.4, prime_min_tokens=0)
    try:
        history = random_tokens(1800, 41)
        answer, final = run(engine, "t1", history, max_tokens=16, session="s")
        assert finished_normally(final)
        wait_quiet(engine)
        base = history + answer
        hit = (len(base) - 1) // BLOCK  # all that was committed: 200 new tokens > KEEP
        a = submit(engine, "a", base + random_tokens(200, 1), 1500, "s")
        b = submit(engine, "b", base + random_tokens(200, 2), 1500, "s")
        results = {"a": a.collect(300), "b": b.collect(300)}
        errors = {k: v for k, v in results.items() if v[1].error is not None}
        assert len(errors) == 1, {k: (len(v[0]), v[1].finish_reason) for k, v in results.items()}
        ((_, (_, lost)),) = errors.items()
        assert lost.finish_reason is FinishReason.ERROR and "out of KV memory" in str(lost.error)
        cached = {k: v[1].stats.cached_tokens_device for k, v in results.items()}
        assert cached == {"a": hit * BLOCK, "b": hit * BLOCK}, cached
        assert engine.cache_stats()["preempted"] == 1
        assert_no_leaks(wait_quiet(engine))
        last = base + random_tokens(200, 3)
        warm, final = run(engine, "last", last, max_tokens=24, session="s")
        assert final.stats.cached_tokens_device >= hit * BLOCK, final.stats
        assert_no_leaks(wait_quiet(engine))
    finally:
        engine.shutdown(drain_timeout_s=5)
    assert cold_answers(tmp_path, {"last": last}, 24)["last"] == warm


def test_eviction_while_a_turn_that_copied_the_prefix_runs(tmp_path):
    """While a warm turn runs on its copy of a cached prefix, a new conversation needs the memory.
    The cache evicts what it may; the turn's prefix slots point at the turn's own blocks (evicting
    them would free nothing) and stay. The newcomer is given the freed blocks, the cached copies
    the turn was served from among them, and writes over them. Both answers equal their cold
    runs, the prefix serves the next turn, and nothing leaks. Holding the prefix twice, the
    newcomer would have to wait for the turn to end."""
    engine = real_engine(tmp_path, blocks=64, gpu_tier_fraction=0.6, prime_min_tokens=0)
    try:  # 63 usable blocks, 37 GPU-tier slots, 8 kept free for the prefill watermark
        other = random_tokens(1800, 52)
        run(engine, "d1", other, max_tokens=16, session="d")  # 14 blocks, evicted first (LRU)
        history = random_tokens(3000, 51)
        answer, final = run(engine, "c1", history, max_tokens=16, session="c")  # 23 blocks
        assert finished_normally(final)
        wait_quiet(engine)
        base = history + answer
        hit = (len(base) - 1) // BLOCK
        warm_prompt = base + random_tokens(200, 53)  # 26 blocks, 23 of them copied from the cache
        stream = submit(engine, "c2", warm_prompt, max_tokens=600, session="c")
        it = iter(stream)
        first = next(it)
        evicted_before = engine.cache_stats()["prefix_cache_evicted_blocks_total"]
        newcomer = random_tokens(28 * BLOCK - 50, 54)  # 28 blocks: fits only beside one copy
        fresh, fresh_final = submit(engine, "e1", newcomer, max_tokens=16, session="e").collect(120)
        assert finished_normally(fresh_final)
        (mid,) = engine.check()
        evicted = engine.cache_stats()["prefix_cache_evicted_blocks_total"] - evicted_before
        warm = list(first.token_ids)
        for event in it:
            warm += event.token_ids
        assert event.finished and finished_normally(event), event
        print(f"evicted while c2 ran: {evicted} blocks; c2 still running with its {hit}-block "
              f"prefix slots on its own blocks: {mid['blocks_pinned_in_sequences']}")  # fmt: skip
        assert evicted > 0
        assert mid["blocks_pinned_in_sequences"] == hit, mid  # c2 ran past e1, prefix kept
        assert event.stats.cached_tokens_device == hit * BLOCK, event.stats
        wait_quiet(engine)
        turn3 = warm_prompt + warm + random_tokens(64, 55)
        again, final3 = run(engine, "c3", turn3, max_tokens=16, session="c")
        assert final3.stats.cached_tokens_device >= hit * BLOCK, final3.stats
        assert_no_leaks(wait_quiet(engine))
    finally:
        engine.shutdown(drain_timeout_s=5)
    assert cold_answers(tmp_path, {"c2": warm_prompt}, 600)["c2"] == warm
    cold = cold_answers(tmp_path, {"e1": newcomer, "c3": turn3}, 16)
    assert cold["e1"] == fresh and cold["c3"] == again


def test_a_request_that_cannot_fit_yet_does_not_empty_the_gpu_tier(tmp_path):
    """A big prompt waiting for a running request's blocks: evicting every cached block could not
    make room for it, and the eviction emptied the GPU tier all the same, each time the waiting
    request was looked at (the next turn of a cached conversation then read cold)."""
    # 10 ms a step: the hog's 600 tokens take at least 6 s, so it is still running when "big" is
    # looked at (unslowed, a quiet machine ran all 600 in under the 1 s the test waits)
    slow = {"environment": {ENV_STEP_SECONDS: "0.01"}}
    engine = real_engine(tmp_path, blocks=64, gpu_tier_fraction=0.6, prime_min_tokens=0, **slow)
    admitted = admissions(engine)
    try:  # 63 usable blocks, 8 kept free for the prefill watermark
        _, final = run(engine, "c1", random_tokens(1800, 71), max_tokens=8, session="c")  # 14 cached
        assert finished_normally(final)
        (idle,) = wait_quiet(engine)
        cached = idle["blocks_pinned"]
        assert cached >= 14, idle
        hog = submit(engine, "hog", random_tokens(3000, 72), 600, "h")  # 24 blocks and growing
        until(lambda: "hog" in admitted)
        big = submit(engine, "big", random_tokens(5000, 73), 4, "b")  # 40 + 8: more than 63 - 24
        time.sleep(1.0)  # steps go by with "big" waiting
        (waiting,) = engine.check()
        assert waiting["live"] == 2, waiting  # the hog still runs, holding its blocks
        assert "big" not in admitted and waiting["pending"] == 1, waiting
        assert waiting["blocks_pinned"] == cached, waiting  # the cache kept what it held
        engine.abort("big")
        engine.abort("hog")
        hog.collect(60), big.collect(60)
        assert_no_leaks(wait_quiet(engine))
    finally:
        engine.shutdown(drain_timeout_s=5)
