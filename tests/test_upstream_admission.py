"""ikcode's admission policy in front of upstream replicas: warm/cold from the front's session
memory, the per-replica cold cap, warm first, and shedding new cold work with 529 + retry-after
(the last one through a real front over a real ikcode replica)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from ikcode.admission import AdmissionConfig
from ikcode.engines.base import CacheLookup, EngineOverloaded
from ikcode.gateway import BackgroundServer, GatewaySettings
from ikcode.upstream import UpstreamConfig, create_upstream_app
from ikcode.upstream.admission import UpstreamAdmission
from tests.test_upstream_support import FRONT_TOKEN, UPSTREAM_TOKEN, EmbeddedReplica, front_records

A, B = "http://a", "http://b"


def _turn(n: int, size: int = 40) -> list[dict]:
    """A conversation of n user/assistant exchanges, each message `size` characters."""
    out = []
    for i in range(n):
        out.append({"role": "user", "content": f"question {i} " + "x" * size})
        out.append({"role": "assistant", "content": f"answer {i} " + "y" * size})
    return out + [{"role": "user", "content": "next"}]


def _extend(messages: list[dict], text: str) -> list[dict]:
    return messages + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": text}]


def test_warm_only_when_the_session_extends_its_prompt_on_the_same_replica():
    async def main() -> None:
        adm = UpstreamAdmission(AdmissionConfig(cold_threshold_tokens=100), [A, B])
        first = await adm.enter("r1", A, "s1", _turn(2))
        assert first.cls == "cold"  # a new session: nothing cached upstream
        adm.done("r1", A)
        grown = _turn(2)[:-1] + [{"role": "user", "content": "next"}, {"role": "assistant", "content": "ok"}]
        warm = await adm.enter("r2", A, "s1", grown + [{"role": "user", "content": "more"}])
        assert warm.cls == "warm" and warm.uncached_tokens < warm.prompt_tokens
        adm.done("r2", A)
        edited = await adm.enter("r3", A, "s1", [{"role": "user", "content": "rewritten " * 80}])
        assert edited.cls == "cold"  # compaction / rewind: the old prefix is gone
        adm.done("r3", A)
        long_tail = _turn(1) + [{"role": "user", "content": "z" * 2000}]
        moved = await adm.enter("r4", B, "s1", long_tail)
        assert moved.cls == "cold"  # another replica holds nothing of it

    asyncio.run(main())


def test_cold_cap_per_replica_and_warm_first():
    async def main() -> None:
        adm = UpstreamAdmission(AdmissionConfig(cold_threshold_tokens=30, max_cold_prefills=1), [A, B])
        await adm.enter("c1", A, "s1", _turn(3))  # cold, admitted: the replica's one cold slot
        second = asyncio.create_task(adm.enter("c2", A, "s2", _turn(3)))
        other = await asyncio.wait_for(adm.enter("c3", B, "s3", _turn(3)), 1)  # B has its own slot
        await asyncio.sleep(0.05)
        assert not second.done()  # the cap holds the second cold request on A
        adm.first_token("c1")
        await asyncio.wait_for(adm.enter("w1", A, "s1", _extend(_turn(3), "a")), 1)
        await asyncio.wait_for(second, 1)  # c1's first token freed A's cold slot
        assert other.cls == "cold" and adm.stats()[A]["queue_wait"]["cold"]["admitted"] == 2

        # Warm first: with A's cold slot taken and a cold request queued, a warm turn passes it.
        queued_cold = asyncio.create_task(adm.enter("c4", A, "s4", _turn(3)))
        await asyncio.sleep(0.02)
        warm = await asyncio.wait_for(adm.enter("w2", A, "s1", _extend(_extend(_turn(3), "a"), "b")), 1)
        assert warm.cls == "warm" and not queued_cold.done()
        queued_cold.cancel()  # the client left while queued: its place is freed
        with pytest.raises(asyncio.CancelledError):
            await queued_cold
        assert not adm.policies[A].queue

    asyncio.run(main())


def test_a_new_session_waiting_for_a_slot_gets_it_when_an_idle_sessions_slot_frees():
    """The slot frees with time, not with an event: with a quiet replica nothing looked again, and
    the new session waited for ever. And a session's idle time starts when its request ends (it
    counted from admission: a long turn lost its slot the moment it ended)."""

    async def main() -> None:
        adm = UpstreamAdmission(AdmissionConfig(max_active_sessions=1, session_idle_s=0.3), [A])
        await adm.enter("a1", A, "sA", _turn(3))
        await asyncio.sleep(0.5)  # a turn longer than session_idle_s
        adm.first_token("a1")
        adm.done("a1")
        with pytest.raises(EngineOverloaded):  # sA's slot is still its own: B is shed once
            await adm.enter("b1", A, "sB", _turn(3))
        retry = asyncio.create_task(adm.enter("b2", A, "sB", _turn(3)))
        await asyncio.sleep(0.1)
        assert not retry.done()
        await asyncio.wait_for(retry, 2)  # sA idle past session_idle_s: its slot went to sB

    asyncio.run(main())


def test_new_cold_work_is_shed_when_the_predicted_wait_exceeds_the_bound():
    async def main() -> None:
        config = AdmissionConfig(
            cold_threshold_tokens=10, prefill_tokens_per_s=50, ttft_bound_s=1.0, max_cold_prefills=1
        )
        adm = UpstreamAdmission(config, [A])
        # The replica's cold slot is free: a new session's cold turn starts, however long it reads.
        busy = await adm.enter("busy", A, "other", [{"role": "user", "content": "v" * 2000}])
        assert busy.cls == "cold"
        # Now it is taken: the next new session cannot start before its retry would come back.
        with pytest.raises(EngineOverloaded) as info:
            await adm.enter("big", A, "new", [{"role": "user", "content": "w" * 2000}])
        assert 1 <= info.value.retry_after_s <= 60
        adm.done("busy")
        # Deferred once: the same session's retry is queued, never shed again.
        again = await adm.enter("big2", A, "new", [{"role": "user", "content": "w" * 2000}])
        assert again.cls == "cold"

    asyncio.run(main())


@pytest.mark.slow
def test_front_sheds_with_529_and_retry_after_then_serves_warm(tmp_path):
    replica = EmbeddedReplica(tmp_path)
    settings = GatewaySettings(
        served_model="tiny",
        context_window=2048,
        max_output_tokens=64,
        auth_tokens={"alice": FRONT_TOKEN},
        request_log_path=tmp_path / "front-requests.jsonl",
    )
    admission = AdmissionConfig(
        cold_threshold_tokens=64, prefill_tokens_per_s=20, ttft_bound_s=2.0, max_cold_prefills=1
    )
    upstream = UpstreamConfig(kind="anthropic", urls=[replica.url], token=UPSTREAM_TOKEN)
    app = create_upstream_app(upstream, settings, admission)
    front = BackgroundServer(app).start()
    try:
        # Another session's cold prefill holds the replica's one cold slot (1000 tokens at 20/s).
        policy = app.state.upstream.admission.policies[replica.url]
        now = time.monotonic()
        policy.offer(policy.make_ticket("busy", CacheLookup(1000), now, "other"), now)
        assert [t.request_id for t in policy.admit(now)] == ["busy"]
        headers = {"x-api-key": FRONT_TOKEN, "x-claude-code-session-id": "sess-1"}
        first = [{"role": "user", "content": "hello there " * 40}]
        body = {"model": "tiny", "max_tokens": 4, "messages": first}
        shed = httpx.post(front.url + "/v1/messages", json=body, headers=headers, timeout=30)
        assert shed.status_code == 529 and shed.json()["error"]["type"] == "overloaded_error"
        assert 1 <= int(shed.headers["retry-after"]) <= 60
        assert replica.records() == []  # shed in front: the replica never saw it
        policy.on_done("busy")
        served = httpx.post(front.url + "/v1/messages", json=body, headers=headers, timeout=30)
        assert served.status_code == 200  # the session's retry is queued, not shed again
        follow = first + [
            {"role": "assistant", "content": served.json()["content"] or "ok"},
            {"role": "user", "content": "and then?"},
        ]
        warm = httpx.post(
            front.url + "/v1/messages", json=dict(body, messages=follow), headers=headers, timeout=30
        )
        assert warm.status_code == 200
        classes = [(r["status"], r.get("admission_class")) for r in front_records(tmp_path)]
        assert classes == [(529, "cold"), (200, "cold"), (200, "warm")]
        health = httpx.get(front.url + "/health", headers={"x-api-key": FRONT_TOKEN}).json()["admission"]
        assert health[replica.url]["queue_wait"]["warm"]["admitted"] == 1
    finally:
        front.stop()
        replica.stop()
