"""Random allocate/append/release workloads against the real PrefixCache: after every step the
invariants hold, budgets are respected, and every cached or promoted block holds the right KV."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ikcode.cache import OutOfBlocks, PrefixCache, hash_blocks
from tests.test_cache_helpers import ByteStore, check_bytes, compute

BS = 2
# A few prompt "families" over a tiny alphabet so that prefixes are shared often.
prompt = st.lists(st.integers(0, 2), min_size=0, max_size=14)
op = st.one_of(
    st.tuples(st.just("alloc"), prompt, st.integers(0, 2)),
    st.tuples(st.just("append"), st.integers(0, 9), st.just(0)),
    st.tuples(st.just("release"), st.integers(0, 9), st.sampled_from(["all", "none", "some"])),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op, max_size=40),
    num_device=st.integers(1, 12),
    num_host=st.integers(0, 10),
    policy=st.sampled_from(["lru", "ikcode"]),
    write_through=st.booleans(),
    hold=st.sampled_from([None, 0.5, 100.0]),
)
def test_random_workloads_keep_invariants(ops, num_device, num_host, policy, write_through, hold):
    now = [0.0]
    store = ByteStore(num_device, num_host)
    c = PrefixCache(
        num_device,
        BS,
        num_host,
        store=store,
        policy=policy,
        write_through=write_through,
        clock=lambda: now[0],
        bytes_per_block=7,
    )
    live: dict[str, list] = {}  # seq -> its full-block keys
    for n, (kind, arg, extra) in enumerate(ops):
        now[0] += 1.0
        if kind == "alloc":
            toks = [t + 3 * (i % 2) for i, t in enumerate(arg)]
            keys = hash_blocks(toks, BS)
            n_blocks = -(-len(toks) // BS) + extra
            seq = f"s{n}"
            free_before = c.num_free_blocks()
            try:
                alloc = c.allocate(seq, keys, n_blocks, session_id=f"u{n % 3}")
            except OutOfBlocks:
                assert c.num_free_blocks() == free_before
                continue
            assert len(alloc.block_table) == n_blocks
            compute(store, alloc, keys, seq)
            live[seq] = keys
        elif live:
            seq = sorted(live)[arg % len(live)]
            if kind == "append":
                try:
                    c.append_block(seq)
                except OutOfBlocks:
                    assert c.num_free_blocks() == 0
            else:
                keys = live.pop(seq)
                committed = {"all": keys, "none": [], "some": keys[: len(keys) // 2]}[extra]
                c.release(seq, committed, hold_s=hold)
        c.check_invariants()
        check_bytes(c, store)
        assert len(c.host) <= num_host
        assert c.snapshot()["prefix_cache_host_bytes_used"] <= 7 * num_host  # the byte budget
        used = sum(1 for rc in c.pool.refcount if rc > 0)
        assert c.num_free_blocks() + used == num_device
    for seq in list(live):
        c.release(seq, [])
    c.check_invariants()
    assert c.num_free_blocks() == num_device  # nothing leaked
