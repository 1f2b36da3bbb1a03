"""The session-prefix figures of the request log: common_prefix against a plain loop."""

from __future__ import annotations

from bisect import bisect_right

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ikcode.gateway import session_prefix
from ikcode.gateway.session_prefix import SessionPrefixes, common_prefix


@pytest.fixture(autouse=True, scope="module")
def small_chunks():
    """Chunks of 7 tokens: the examples cross chunk ends and segment ends at every offset."""
    chunk = session_prefix._CHUNK_TOKENS
    session_prefix._CHUNK_TOKENS = 7
    yield
    session_prefix._CHUNK_TOKENS = chunk


def reference(a: list[int], b: list[int], boundaries: list[int]) -> tuple[int, int | None]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    if n == min(len(a), len(b)):
        return n, None
    return n, bisect_right(boundaries, n)  # the segment [boundaries[i-1], boundaries[i]) holding n


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 3), max_size=90),
    st.lists(st.integers(0, 3), max_size=90),
    st.lists(st.integers(1, 90), max_size=8),
    st.integers(0, 100),
)
def test_common_prefix_matches_a_plain_loop(a, b, cuts, shared):
    b = a[: min(shared, len(a))] + b  # long common prefixes are the usual case
    boundaries = sorted(set(cuts))
    assert common_prefix(a, b, boundaries) == reference(a, b, boundaries)
    known = reference(a, b, boundaries)[0]
    assert common_prefix(a, b, boundaries, known) == reference(a, b, boundaries)


def test_observe_compares_only_past_the_copied_part():
    sessions = SessionPrefixes()
    first = list(range(1000))
    assert sessions.observe("s", first, [500, 1000]) is None
    second = first[:990] + [7] * 20
    shared = sessions.observe("s", second, [500, 1000], copied_from=(first, 990))
    assert (shared.shared_tokens, shared.previous_tokens, shared.segment) == (990, 1000, 1)
    # A copy of another prompt than the session's previous one says nothing about it.
    third = [5] + second[1:]
    shared = sessions.observe("s", third, [500, 1000], copied_from=(first, 990))
    assert (shared.shared_tokens, shared.segment) == (0, 0)
