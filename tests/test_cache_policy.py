import pytest

from ikcode.cache import LRUPolicy, PrefixCache, hash_blocks, make_policy
from ikcode.cache.ikcode_policy import IkcodePolicy

BS = 4


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def run(c: PrefixCache, seq: str, keys: list, n: int | None = None, **release_kw) -> int:
    a = c.allocate(seq, keys, n if n is not None else len(keys))
    c.release(seq, keys, **release_kw)
    return a.cached_blocks


def test_make_policy_names():
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("ikcode"), IkcodePolicy)
    with pytest.raises(ValueError):
        make_policy("nope")


def test_shared_root_survives_a_flood_of_one_off_prompts():
    root = toks(8, 0)  # system prompt + tools: 2 blocks
    for policy, survives in (("lru", False), ("ikcode", True)):
        c = PrefixCache(8, BS, policy=policy)
        for s in range(3):  # three sessions share the root
            run(c, f"s{s}", hash_blocks(root + toks(4, 100 * (s + 1)), BS))
        for s in range(6):  # one-off prompts, each evicting the LRU
            run(c, f"x{s}", hash_blocks(toks(8, 1000 + 10 * s), BS))
        assert (c.match(hash_blocks(root, BS)).device_blocks == 2) is survives, policy
        c.check_invariants()


def test_session_hold_keeps_the_tail_until_the_deadline():
    now = [0.0]
    c = PrefixCache(6, BS, policy="ikcode", clock=lambda: now[0])
    mine = hash_blocks(toks(12), BS)
    run(c, "agent-step-1", mine, hold_s=30.0)  # ended in a tool call: back soon
    for s in range(3):
        now[0] += 1.0
        run(c, f"other{s}", hash_blocks(toks(12, 500 + 20 * s), BS))
    assert c.match(mine).device_blocks == 3  # still there: the others cycled through the rest
    now[0] = 100.0  # the hold expired: now it is the first to go
    run(c, "late", hash_blocks(toks(4, 900), BS))
    assert c.match(mine).device_blocks < 3
    c.check_invariants()


def test_lru_does_not_hold():
    now = [0.0]
    c = PrefixCache(6, BS, policy="lru", clock=lambda: now[0])
    mine = hash_blocks(toks(12), BS)
    run(c, "a", mine, hold_s=30.0)
    for s in range(3):
        run(c, f"o{s}", hash_blocks(toks(12, 500 + 20 * s), BS))
    assert c.match(mine).device_blocks == 0


def test_salting_prevents_cross_user_hits_but_shared_roots_are_shared():
    c = PrefixCache(64, BS)
    system = toks(8, 0)
    doc = toks(16, 300)
    for salt in ("alice", "bob"):
        keys = hash_blocks(system + doc, BS, salt=salt)
        assert run(c, salt, keys) == 0  # bob never hits alice's blocks
    c2 = PrefixCache(64, BS)
    a = hash_blocks(system + doc, BS, salt="alice", shared_prefix_tokens=8)
    b = hash_blocks(system + doc, BS, salt="bob", shared_prefix_tokens=8)
    assert run(c2, "alice", a) == 0
    assert run(c2, "bob", b) == 2  # the system prompt only
    assert run(c2, "alice2", a) == 6


def test_holds_renewed_turn_after_turn_leave_no_growing_heap_behind():
    """An agent's blocks held again every turn on a device with room to spare: each renewal left
    its old deadline in the heap, and only an eviction (none came) cleared them."""
    now = [0.0]
    cache = PrefixCache(4_000, 16, policy="ikcode", clock=lambda: now[0])
    tokens = list(range(200 * 16))
    for turn in range(100):
        tokens += [7] * 160
        hashes = hash_blocks(tokens, 16, "user")
        cache.allocate(f"s{turn}", hashes, -(-len(tokens) // 16), session_id="sess", num_tokens=len(tokens))
        now[0] += 5.0
        cache.release(f"s{turn}", hashes, session_id="sess", hold_s=60.0)
        now[0] += 5.0
    policy = cache.policy
    assert len(policy._deadlines) <= 2 * len(policy._held) + 1024  # noqa: SLF001
    cache.check_invariants()
