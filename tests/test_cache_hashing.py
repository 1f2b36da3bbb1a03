from ikcode.cache import blocks_for_budget, hash_blocks, kv_bytes_per_block


def test_only_full_blocks_get_keys():
    assert len(hash_blocks(list(range(15)), 4)) == 3
    assert len(hash_blocks(list(range(16)), 4)) == 4
    assert hash_blocks([1, 2, 3], 4) == []


def test_keys_are_chained_prefixes():
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4)
    assert b[:2] == a
    # Same second block after a different first block: a different key (the chain covers the parent).
    c = hash_blocks([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert c[1] != a[1] and c[0] != a[0]
    assert len(set(b)) == 3


def test_incremental_hashing_continues_the_chain():
    toks = list(range(100, 124))
    whole = hash_blocks(toks, 4)
    assert hash_blocks(toks[8:], 4, parent=whole[1]) == whole[2:]


def test_salt_isolates_and_shared_prefix_stays_shared():
    toks = list(range(32))
    plain = hash_blocks(toks, 4)
    alice = hash_blocks(toks, 4, salt="alice")
    bob = hash_blocks(toks, 4, salt="bob")
    assert not set(alice) & set(bob) and not set(alice) & set(plain)
    # First 10 tokens shared: blocks 0 and 1 (tokens 0..7) lie inside, block 2 (8..11) does not.
    a = hash_blocks(toks, 4, salt="alice", shared_prefix_tokens=10)
    b = hash_blocks(toks, 4, salt="bob", shared_prefix_tokens=10)
    assert a[:2] == b[:2] == plain[:2]
    assert not set(a[2:]) & set(b[2:]) and not set(a[2:]) & set(plain)


def test_budget_helpers():
    assert kv_bytes_per_block(30, 3, 64, 16, 2) == 2 * 30 * 3 * 64 * 16 * 2
    assert blocks_for_budget(16, tokens_budget=1000) == 62
    assert blocks_for_budget(16, bytes_budget=10_000, bytes_per_block=1000) == 10
    assert blocks_for_budget(16, tokens_budget=64, bytes_budget=10_000, bytes_per_block=1000) == 4
