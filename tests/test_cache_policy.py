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


def keys_of(tag: str, n: int) -> list:
    return hash_blocks(list(range(n)), 1, salt=tag)


def test_an_expired_hold_gives_shared_root_blocks_back_their_protection():
    """A session's step ending in a tool call holds every block it released, the shared system
    prompt and tools included; when the hold ran out they went to the front of probation, the
    first to be evicted, ahead of one-off prompts."""

    def root_left(hold_s: float | None) -> int:
        now = [0.0]
        c = PrefixCache(20, 1, policy="ikcode", clock=lambda: now[0])
        root = list(range(1000, 1004))  # 4 blocks every session shares
        for s, tail in (("s0", [1, 2]), ("s1", [3, 4])):
            keys = hash_blocks(root + tail, 1)
            c.allocate(s, keys, 6, session_id=s)
            c.release(s, keys, hold_s=hold_s if s == "s1" else None)  # s1 hits the root: shared
        now[0] = 100.0  # the hold ran out long ago
        for i in range(2):
            one_off = hash_blocks(list(range(5000 + 10 * i, 5003 + 10 * i)), 1)
            c.allocate(f"o{i}", one_off, 3, session_id=f"o{i}")
            c.release(f"o{i}", one_off)
        c.allocate("big", hash_blocks(list(range(9000, 9010)), 1), 10, session_id="big")
        c.check_invariants()
        return c.match(hash_blocks(root, 1)).device_blocks

    assert root_left(None) == 4
    assert root_left(5.0) == 4


def test_expired_holds_do_not_take_the_quota_of_a_live_one():
    """Holds that ran out stayed counted against the held cap until the next eviction, so a new
    session's hold fell to probation while nothing was held any more."""
    now = [0.0]
    c = PrefixCache(20, 1, policy="ikcode", clock=lambda: now[0])  # held cap: 10 blocks
    first, live, big = keys_of("A", 10), keys_of("B", 4), keys_of("C", 14)
    c.allocate("a", first, 10, session_id="sa")
    c.release("a", first, hold_s=5.0)
    now[0] = 100.0  # that hold is over
    c.allocate("b", live, 4, session_id="sb")
    c.release("b", live, hold_s=30.0)
    assert c.policy.num_held() == 4
    now[0] = 101.0
    c.allocate("c", big, 14, session_id="sc")  # room only by evicting: not the live hold
    assert c.match(live).device_blocks == 4
    c.check_invariants()


def test_a_hold_the_cap_cuts_short_keeps_the_head_of_the_sequence():
    """A hit starts at the first block: near the cap the tail was held (blocks arrive tail
    first) and the head left to probation, so after pressure the session hit nothing while its
    held tail took quota."""
    now = [0.0]
    c = PrefixCache(20, 1, policy="ikcode", clock=lambda: now[0])  # held cap: 10 blocks
    first, second, other = keys_of("A", 8), keys_of("B", 6), keys_of("C", 10)
    for seq, keys in (("a", first), ("b", second)):
        c.allocate(seq, keys, len(keys), session_id=seq)
        c.release(seq, keys, hold_s=60.0)
    now[0] = 1.0
    c.allocate("c", other, 10, session_id="sc")  # 6 blocks free: 4 evicted
    assert c.match(second).device_blocks == 2  # the two blocks the cap let it hold: its head
    c.check_invariants()
