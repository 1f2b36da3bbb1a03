"""Cache commit on release (with release lag), the final-token bug reproduced, pool accounting,
chunked prefill interleaving, back-pressure and preemption."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from ikcode.engines.base import EngineRequest, FinishReason, LifecycleKind, SamplingParams
from tests.tiny_model import assert_pool_clean, tiny_engine, wait_idle


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def _repeat_hit_rate(engine, prompt: list[int]) -> float:
    released = threading.Event()
    engine.add_listener(lambda e: released.set() if e.kind is LifecycleKind.RELEASED else None)
    engine.submit(EngineRequest("first", prompt, SamplingParams(max_tokens=4))).collect(30)
    assert released.wait(10)  # the next turn comes after the engine let go of the first
    _, final = engine.submit(
        EngineRequest("again", prompt + [5, 6, 7], SamplingParams(max_tokens=4))
    ).collect(30)
    return final.stats.cached_tokens / final.stats.prompt_tokens


@pytest.mark.parametrize("lag", [0, 1, 2, 3])
def test_release_lag_still_hits(lag: int):
    engine = tiny_engine(release_lag_steps=lag, kv_memory_bytes=1 << 20)
    events = []
    engine.add_listener(lambda e: events.append(e.kind))
    assert _repeat_hit_rate(engine, _prompt(lag, 400)) >= 0.95
    assert events[:4] == [
        LifecycleKind.ADMITTED,
        LifecycleKind.FIRST_TOKEN,
        LifecycleKind.FINISHED,
        LifecycleKind.RELEASED,
    ]
    assert_pool_clean(engine)
    engine.shutdown()


@pytest.mark.parametrize("lag", [0, 2])
def test_the_final_token_bug_engine_never_hits(lag: int):
    """The stand-in for the published adapter bug (used by the doctor's tests) really misses."""
    engine = tiny_engine(release_lag_steps=lag, final_token_bug=True, kv_memory_bytes=1 << 20)
    assert _repeat_hit_rate(engine, _prompt(10 + lag, 400)) == 0.0
    assert_pool_clean(engine)
    engine.shutdown()


@pytest.mark.parametrize("lag", [1, 3])
def test_commit_waits_for_release_not_the_final_token(lag: int):
    """While a sequence is finished but not yet released (engines close a sequence steps after
    its final token), it still holds its blocks in the cache and none of them is committed;
    they are committed at release. Committing (or letting go of the blocks) at the final token
    fails here even when a later repeat would still hit."""
    engine = tiny_engine(release_lag_steps=lag, kv_memory_bytes=1 << 20, start=False)
    prompt = _prompt(30 + lag, 200)
    full_blocks = len(prompt) // engine.config.block_size
    probes: list[tuple[str, int, int]] = []  # (event or "step", tokens the cache would serve, blocks held)
    step = engine.step

    def probe(what: str) -> None:
        try:
            held = len(engine.cache.block_table("r"))
        except KeyError:
            held = -1  # the cache no longer knows the sequence
        probes.append((what, engine.lookup(prompt).cached_tokens, held))

    def probed_step() -> None:
        step()
        finished = [e for e in events if e is LifecycleKind.FINISHED]
        if finished and LifecycleKind.RELEASED not in events:
            probe("step")

    events: list[LifecycleKind] = []
    engine.add_listener(lambda e: events.append(e.kind))
    engine.add_listener(lambda e: probe(e.kind.value) if e.kind is LifecycleKind.RELEASED else None)
    engine.step = probed_step
    engine.start()
    engine.submit(EngineRequest("r", prompt, SamplingParams(max_tokens=3, ignore_eos=True))).collect(30)
    wait_idle(engine)
    between = [p for p in probes if p[0] == "step"]
    assert len(between) == lag, probes  # the steps between the final token and the release
    for _, cached_tokens, held in between:
        assert cached_tokens == 0, f"committed before release: {probes}"
        assert held >= full_blocks, f"blocks let go before release: {probes}"
    released = [p for p in probes if p[0] == "released"]
    assert released and released[0][1] == full_blocks * engine.config.block_size, probes
    assert_pool_clean(engine)
    engine.shutdown()


def test_lookup_is_side_effect_free_and_matches_admission():
    engine = tiny_engine(kv_memory_bytes=1 << 20)
    prompt = _prompt(1, 200)
    assert engine.lookup(prompt).cached_tokens == 0
    engine.submit(EngineRequest("a", prompt, SamplingParams(max_tokens=2))).collect(30)
    assert_pool_clean(engine)
    before = engine.cache.stats.query_tokens
    look = engine.lookup(prompt + [9] * 30)
    assert look.device_tokens == 192 and look.uncached_tokens == 230 - 192
    assert engine.lookup(prompt, cache_salt="other user").cached_tokens == 0
    assert engine.cache.stats.query_tokens == before
    _, final = engine.submit(EngineRequest("b", prompt + [9] * 30, SamplingParams(max_tokens=2))).collect(30)
    assert final.stats.cached_tokens_device == 192
    assert final.stats.computed_tokens == 230 - 192
    engine.shutdown()


def test_lookup_of_a_block_aligned_prompt_leaves_its_last_block_to_compute():
    """The last prompt token is always run (its logits give the first output token): a repeat of
    a 192-token prompt reads 176 from cache and computes 16, and the lookup says so (it said 192
    cached, 0 to compute: the client's message_start usage and admission's warm/cold call)."""
    engine = tiny_engine(kv_memory_bytes=1 << 20)
    prompt = _prompt(1, 192)
    engine.submit(EngineRequest("a", prompt, SamplingParams(max_tokens=2))).collect(30)
    assert_pool_clean(engine)
    look = engine.lookup(prompt)
    _, final = engine.submit(EngineRequest("b", prompt, SamplingParams(max_tokens=2))).collect(30)
    assert final.stats.cached_tokens == 176 and final.stats.computed_tokens == 16
    assert (look.cached_tokens, look.uncached_tokens) == (176, 16)
    engine.shutdown()


def test_chunked_prefill_lets_a_short_request_finish_first():
    engine = tiny_engine(start=False, kv_memory_bytes=1 << 20, max_prefill_tokens_per_step=32)
    long = engine.submit(EngineRequest("long", _prompt(2, 1000), SamplingParams(max_tokens=2)))
    short = engine.submit(
        EngineRequest("short", _prompt(3, 10), SamplingParams(max_tokens=3, ignore_eos=True))
    )
    engine.start()
    _, s_final = short.collect(30)
    _, l_final = long.collect(30)
    assert s_final.stats.finished_at < l_final.stats.first_token_at
    assert_pool_clean(engine)
    engine.shutdown()


def test_back_pressure_and_preemption_never_leak():
    # 12 blocks = 192 tokens: four requests cannot all hold their blocks at once.
    engine = tiny_engine(start=False, kv_memory_bytes=12 * 8192, max_num_seqs=4)
    assert engine.num_blocks == 12
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    streams = [engine.submit(EngineRequest(f"r{i}", _prompt(20 + i, 50), params)) for i in range(4)]
    engine.start()
    for s in streams:
        tokens, final = s.collect(60)
        assert final.finish_reason is FinishReason.LENGTH and len(tokens) == 60
    assert_pool_clean(engine)
    engine.shutdown()


def test_stop_tokens_and_eos():
    engine = tiny_engine()
    prompt = _prompt(4, 30)
    free, _ = engine.submit(
        EngineRequest("free", prompt, SamplingParams(max_tokens=10, ignore_eos=True))
    ).collect(30)
    stop_at = free[3]
    tokens, final = engine.submit(
        EngineRequest("stop", prompt, SamplingParams(max_tokens=10, stop_token_ids=(stop_at,)))
    ).collect(30)
    assert tokens == free[: free.index(stop_at) + 1] and final.finish_reason is FinishReason.STOP
    assert final.stats.output_tokens == len(tokens)
    engine.shutdown()


@pytest.mark.parametrize("salt", ["", "user-a"])
def test_sequence_block_hashes_grow_incrementally_and_match_a_full_hash(salt: str):
    from ikcode.cache import hash_blocks
    from ikcode.engines.base import RequestStream
    from ikcode.engines.embedded.sequence import Sequence

    prompt = _prompt(11, 37)
    seq = Sequence(EngineRequest("h", prompt, cache_salt=salt), RequestStream("h"), max_total_tokens=100)
    assert seq.block_hashes(len(prompt), 8) == hash_blocks(prompt, 8, salt)
    seq.token_ids.extend(_prompt(12, 20))  # decoded tokens
    assert seq.block_hashes(len(seq.token_ids), 8) == hash_blocks(seq.token_ids, 8, salt)
    assert seq.block_hashes(17, 8) == hash_blocks(seq.token_ids[:16], 8, salt)


def test_carried_block_hashes_spare_the_engine_thread_from_hashing(monkeypatch):
    """A request that carries its prompt's block hashes (the gateway's incremental hasher) is
    looked up, admitted and committed without the prompt being hashed again; hashes made for
    another salt are ignored."""
    from ikcode.cache import hash_blocks
    from ikcode.engines.base import PromptBlockHashes
    from ikcode.engines.embedded import engine as engine_module
    from ikcode.engines.embedded import sequence as sequence_module

    engine = tiny_engine(kv_memory_bytes=1 << 20)
    bs = engine.config.block_size
    prompt = _prompt(40, 300)
    carried = PromptBlockHashes(bs, "", hash_blocks(prompt, bs))
    hashed_tokens: list[int] = []

    def counting(module):
        real = module.hash_blocks

        def hash_counted(tokens, *args, **kwargs):
            hashed_tokens.append(len(tokens))
            return real(tokens, *args, **kwargs)

        monkeypatch.setattr(module, "hash_blocks", hash_counted)

    counting(engine_module)
    counting(sequence_module)
    assert engine.lookup(prompt, "", carried).cached_tokens == 0
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine.submit(EngineRequest("a", prompt, params, block_hashes=carried)).collect(30)
    assert_pool_clean(engine)
    assert sum(hashed_tokens) <= 20 + bs, hashed_tokens  # only blocks filled by output tokens
    assert engine.lookup(prompt, "", carried).cached_tokens == (300 // bs) * bs
    hashed_tokens.clear()
    longer = prompt + [7] * 40  # the carried hashes do not cover it: hashed on the engine thread
    _, final = engine.submit(EngineRequest("b", longer, params, block_hashes=carried)).collect(30)
    assert final.stats.cached_tokens == (300 // bs) * bs
    wait_idle(engine)  # the commit at release hashes the blocks the output filled
    assert sum(hashed_tokens) >= 340, hashed_tokens
    hashed_tokens.clear()
    salted = PromptBlockHashes(bs, "someone else", hash_blocks(prompt, bs, "someone else"))
    assert engine.lookup(prompt, "", salted).cached_tokens == (300 // bs) * bs  # rehashed for ""
    assert sum(hashed_tokens) == 300
    engine.shutdown()
