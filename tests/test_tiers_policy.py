"""The ikcode policy's returning-session rule, against plain LRU, on the real PrefixCache."""

from __future__ import annotations

from ikcode.cache import IkcodePolicy, PrefixCache, hash_blocks

BS = 4


def keys(seed: int, blocks: int) -> list[bytes]:
    return hash_blocks([seed * 1000 + i for i in range(blocks * BS)], BS)


def step(cache: PrefixCache, seq: str, hashes: list[bytes], session: str | None) -> int:
    """One request: allocate, release with everything committed; returns its cached blocks."""
    alloc = cache.allocate(seq, hashes, len(hashes), session_id=session)
    cache.release(seq, hashes)
    return alloc.cached_blocks


def second_step_survives(policy: str | IkcodePolicy, with_sessions: bool) -> int:
    """A session's two steps, then a flood of one-off sessions, then its third step."""
    cache = PrefixCache(20, BS, policy=policy)
    conversation = keys(1, 10)
    session = "agent" if with_sessions else None
    step(cache, "a1", conversation[:6], session)
    step(cache, "a2", conversation[:9], session)  # its 2nd step: 3 new tail blocks
    for i in range(3):  # one-off requests of other sessions, 5 blocks each: 15 > the 11 free
        step(cache, f"x{i}", keys(10 + i, 5), f"other{i}" if with_sessions else None)
    cached = step(cache, "a3", conversation, session)
    cache.check_invariants()
    return cached


def test_returning_session_keeps_its_whole_conversation_including_the_new_tail():
    assert second_step_survives("ikcode", with_sessions=True) == 9
    assert second_step_survives("lru", with_sessions=True) < 9


def test_without_session_ids_only_blocks_already_reused_are_protected():
    # Per-block rule: the 6 blocks hit by a2 are protected, a2's new tail is not.
    assert second_step_survives("ikcode", with_sessions=False) == 6


def test_new_sessions_keep_a_window_past_the_protected_cap():
    cache = PrefixCache(20, BS, policy=IkcodePolicy(protected_fraction=0.5))
    for s in range(2):  # two returning sessions of 8 blocks: 16 protected > the cap of 10
        conversation = keys(s + 1, 8)
        step(cache, f"s{s}-1", conversation[:4], f"s{s}")
        step(cache, f"s{s}-2", conversation, f"s{s}")
    assert len(cache.policy._protected) <= 10
    step(cache, "new-1", keys(50, 4), "new")
    step(cache, "filler", keys(60, 4), "filler")  # evicts from probation, not the newest session
    assert cache.match(keys(50, 4)).device_blocks == 4
    cache.check_invariants()


def test_trace_sessions_follow_continuation_not_a_shared_root():
    from ikcode.cache.trace_replay import load_trace

    records = [  # two conversations over one shared system-prompt block 0, then each one's next turn
        {"timestamp": 0, "input_length": 1536, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 1, "input_length": 1536, "output_length": 5, "hash_ids": [0, 3, 4]},
        {"timestamp": 2, "input_length": 2000, "output_length": 5, "hash_ids": [0, 1, 2, 5]},
        {"timestamp": 3, "input_length": 2000, "output_length": 5, "hash_ids": [0, 3, 4, 6]},
        {"timestamp": 4, "input_length": 300, "output_length": 5, "hash_ids": [0]},
    ]
    a1, b1, a2, b2, alone = (r.session for r in load_trace(records))
    assert a1 != b1 and a2 == a1 and b2 == b1
    assert alone not in (a1, b1)  # a bare shared root does not join a conversation
