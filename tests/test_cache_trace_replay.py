import json
from pathlib import Path

import pytest

from ikcode.cache.references import belady_hits, infinite_hits
from ikcode.cache.trace_replay import format_table, load_trace, replay_trace
from tests.data import make_tiny_trace as tiny

TRACE = Path(__file__).parent / "data" / "tiny-trace.jsonl"
EXP = tiny.expected()


def test_trace_file_matches_its_generator():
    assert [json.loads(line) for line in TRACE.read_text().splitlines()] == tiny.records()


def test_infinite_capacity_reaches_the_bound():
    r = replay_trace(TRACE, device_tokens=512 * EXP["distinct_blocks"])
    assert r["infinite_bound"]["hit_ratio_blocks"] == pytest.approx(EXP["infinite"])
    assert r["hit_ratio_blocks"] == pytest.approx(EXP["infinite"])
    assert r["hit_ratio_tokens"] == pytest.approx(EXP["infinite"])  # all blocks are full
    assert r["belady"]["hit_ratio_blocks"] == pytest.approx(EXP["infinite"])


@pytest.mark.parametrize("policy", ["lru", "ikcode"])
def test_small_device_keeps_only_the_shared_root(policy):
    r = replay_trace(TRACE, device_tokens=512 * 32, policy=policy)
    assert r["hit_ratio_blocks"] == pytest.approx(EXP["lru_32"])
    assert r["by_tier"]["host"]["hit_ratio_blocks"] == 0
    assert EXP["lru_32"] <= r["belady"]["hit_ratio_blocks"] <= EXP["infinite"]
    assert r["stats"]["prefix_cache_regret_blocks_total"] > 0


def test_host_tier_recovers_the_infinite_bound():
    r = replay_trace(TRACE, device_tokens=512 * 32, host_tokens=512 * 512)
    assert r["hit_ratio_blocks"] == pytest.approx(EXP["infinite"])
    assert r["by_tier"]["device"]["hit_ratio_blocks"] == pytest.approx(EXP["lru_32"])
    assert r["stats"]["prefix_cache_host_blocks_used"] <= 512
    assert r["stats"]["prefix_cache_regret_blocks_total"] == 0
    assert "belady_device_plus_host" in r
    assert "hit tok" in format_table([r])


def test_partial_last_block_counts_its_tokens():
    recs = [
        {"timestamp": 0, "input_length": 700, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [1, 3]},
    ]
    r = replay_trace(recs, device_tokens=512 * 8)
    assert r["hit_ratio_blocks"] == pytest.approx(1 / 4)
    assert r["hit_ratio_tokens"] == pytest.approx(512 / 1300)


def test_belady_is_optimal_on_a_classic_sequence():
    # Single-block requests a b c a b d a b with room for 2: Belady keeps a and b after c.
    reqs = [[k] for k in "abcabdab"]
    assert sum(belady_hits(reqs, 2)) == 4 == sum(infinite_hits(reqs))
    recs = [
        {"timestamp": i, "input_length": 512, "output_length": 1, "hash_ids": [ord(k)]}
        for i, k in enumerate("abcabdab")
    ]
    r = replay_trace(recs, device_tokens=1024)
    assert r["hit_ratio_blocks"] == 0  # LRU thrashes on this sequence
    assert r["belady"]["hit_ratio_blocks"] == pytest.approx(0.5)


def test_oversize_requests_are_full_misses():
    r = replay_trace(load_trace(TRACE), device_tokens=512 * 8)
    assert r["oversize_requests"] > 0 and 0 <= r["hit_ratio_blocks"] < EXP["lru_32"]


SHARED_TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake-synthetic-trace.jsonl"


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_TRACE.exists(), reason="the shared Mooncake synthetic trace is not here")
def test_plain_lru_reproduces_the_published_replay_figures():
    requests = load_trace(SHARED_TRACE)
    # Published: infinite cache 0.640 of blocks (0.651 of tokens); LRU 1,000 blocks 0.083, 8,000 0.372.
    r = replay_trace(requests, device_tokens=512 * 1000)
    assert r["infinite_bound"]["hit_ratio_blocks"] == pytest.approx(0.640, abs=0.001)
    assert r["infinite_bound"]["hit_ratio_tokens"] == pytest.approx(0.651, abs=0.001)
    assert r["hit_ratio_blocks"] == pytest.approx(0.083, abs=0.005)
    assert replay_trace(requests, 512 * 8000, references=False)["hit_ratio_blocks"] == pytest.approx(
        0.372, abs=0.005
    )
