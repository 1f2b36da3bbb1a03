"""Session holds end to end: a request that asks for a hold (EngineRequest.hold_tail_s) keeps its
blocks on the device across traffic that would otherwise evict them, for a bounded time, and only
when it finished normally."""

from __future__ import annotations

import time

import pytest
import torch

from ikcode.engines.base import EngineRequest, SamplingParams
from tests.test_tiers_engine import BLOCK_BYTES, fill_device, prompt_of, run
from tests.tiny_model import assert_pool_clean, tiny_engine


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def session_engine(**config):
    defaults = dict(
        kv_memory_bytes=32 * BLOCK_BYTES, host_kv_memory_bytes=128 * BLOCK_BYTES, cache_policy="ikcode"
    )
    defaults.update(config)
    return tiny_engine(**defaults)


def next_step_tiers(hold_s: float | None, wait_s: float = 0.0, policy: str = "ikcode") -> tuple[int, int]:
    """(device, host) cached tokens of a session's next step after other sessions filled the device."""
    engine = session_engine(cache_policy=policy)
    prefix = prompt_of(5, 192)  # 12 blocks: within the policy's held share (half the device)
    run(engine, "step1", prefix, session_id="s1", hold_tail_s=hold_s)
    time.sleep(wait_s)
    fill_device(engine, "others", rounds=3, blocks=16)  # 48 blocks through 20 unheld ones
    _, stats = run(engine, "step2", prefix + [7] * 20, session_id="s1")
    assert_pool_clean(engine)
    engine.shutdown()
    return stats.cached_tokens_device, stats.cached_tokens_host


def test_held_session_stays_on_device():
    assert next_step_tiers(hold_s=30.0) == (192, 0)


def test_without_hold_the_session_goes_to_host():
    assert next_step_tiers(hold_s=None) == (0, 192)


def test_hold_is_bounded_in_time():
    assert next_step_tiers(hold_s=0.05, wait_s=0.2) == (0, 192)


def test_plain_lru_ignores_holds():
    # The baseline stays the baseline: holds are a property of the ikcode policy only.
    assert next_step_tiers(hold_s=30.0, policy="lru") == (0, 192)


def test_aborted_request_is_not_held():
    engine = session_engine()
    stream = engine.submit(
        EngineRequest(
            "s1",
            prompt_of(6, 192),
            SamplingParams(max_tokens=500, ignore_eos=True),
            session_id="s1",
            hold_tail_s=30.0,
        )
    )
    for event in stream:
        if event.token_ids:
            stream.abort()  # decoding: its prompt blocks are cached, but the client is gone
    assert stream.final is not None and stream.final.finish_reason.value == "abort"
    assert_pool_clean(engine)
    assert engine.cache.policy.num_held() == 0
    engine.shutdown()


def test_holds_never_take_more_than_their_share_of_the_device():
    engine = session_engine()
    for i in range(4):  # 4 sessions x 12 blocks held would be 48 > 32 blocks
        run(engine, f"s{i}", prompt_of(10 + i, 192), session_id=f"s{i}", hold_tail_s=30.0)
        assert engine.cache.policy.num_held() <= engine.num_blocks // 2
    fill_device(engine, "others")  # still possible: holds yield once nothing else is left
    assert_pool_clean(engine)
    assert engine.cache.num_cached_blocks <= engine.num_blocks
    engine.shutdown()
