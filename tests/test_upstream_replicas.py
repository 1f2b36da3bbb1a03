"""Several replicas (real ikcode servers on 127.0.0.1): sessions stay on their replica, a dead
replica's sessions move on with at most one retry seen by the client."""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from dataclasses import replace

import httpx
import pytest

from ikcode.auth import user_session
from ikcode.gateway import BackgroundServer
from ikcode.upstream import Router
from tests.test_upstream_support import FRONT_TOKEN, EmbeddedReplica, front_app, front_records, front_server

pytestmark = pytest.mark.slow


def _turns(
    front_url: str,
    session: str,
    turns: int,
    outcomes: list,
    start_barrier=None,
    max_attempts: int = 2,
    pause_s: float = 0.0,
):
    """One agent: a growing conversation, streamed; a failed attempt is retried once, like a client."""
    messages = [{"role": "user", "content": f"session {session}: read the repository layout " * 6}]
    headers = {"x-api-key": FRONT_TOKEN, "X-Claude-Code-Session-Id": session}
    with httpx.Client(timeout=60) as client:
        for turn in range(turns):
            if start_barrier is not None and turn == 2:
                start_barrier.wait(30)
            if turn >= 2 and pause_s:
                time.sleep(pause_s)  # a tool runs between steps: the kill lands mid-conversation
            body = {
                "model": "tiny",
                "max_tokens": 4,
                "system": f"agent {session}",
                "messages": messages,
                "stream": True,
            }
            for _attempt in range(max_attempts):
                try:
                    with client.stream(
                        "POST", front_url + "/v1/messages", json=body, headers=headers
                    ) as resp:
                        text = resp.read().decode()
                    ok = (
                        resp.status_code == 200
                        and "event: message_stop" in text
                        and "event: error" not in text
                    )
                except httpx.HTTPError:
                    ok = False
                outcomes.append((session, turn, ok))
                if ok:
                    break
            messages = messages + [
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": f"turn {turn}: next step please"},
            ]


def test_router_guard_moves_only_overloaded_sessions():
    router = Router(["http://a", "http://b"], max_in_flight=2)
    first = router.pick("s1", "k1")
    assert router.pick("s1", "k1") is first  # in flight 2 now: at the guard
    moved = router.pick("s1", "k1")  # overloaded and the other replica is idle: move
    assert moved is not first and router.moves["overloaded"] == 1
    assert router.pick("s1", "k1") is moved  # it sticks to the new one
    router.mark_down(moved, "test")
    assert router.pick("s1", "k1") is first and router.moves["replica_down"] == 1
    router.mark_down(first, "test")
    with pytest.raises(Exception, match="no healthy"):
        router.pick("s2", "k2")


def test_new_sessions_spread_when_their_prefixes_hash_to_one_replica():
    router = Router(["http://a", "http://b"], max_in_flight=8)
    placed = [router.pick(f"s{i}", "one shared prefix key") for i in range(6)]
    for replica in placed:
        router.release(replica)
    counts = Counter(r.url for r in placed)
    assert set(counts) == {"http://a", "http://b"} and max(counts.values()) - min(counts.values()) <= 3
    assert all(router.pick(f"s{i}", "one shared prefix key") is placed[i] for i in range(6))  # sticky


def test_sessions_stay_on_their_replica(tmp_path):
    replicas = [EmbeddedReplica(tmp_path, f"r{i}") for i in range(2)]
    front = front_server(tmp_path, "anthropic", [r.url for r in replicas], max_in_flight=8)
    try:
        outcomes: list = []
        sessions = [f"sess-{i}" for i in range(6)]
        threads = [threading.Thread(target=_turns, args=(front.url, s, 4, outcomes)) for s in sessions]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert all(ok for _, _, ok in outcomes) and len(outcomes) == 24
        per_session: dict[str, Counter] = defaultdict(Counter)
        for record in front_records(tmp_path):
            per_session[record["session_id"]][record["replica"]] += 1
        for session in sessions:
            top = per_session[session].most_common(1)[0][1]
            assert top / sum(per_session[session].values()) >= 0.95, per_session
        assert len({per_session[s].most_common(1)[0][0] for s in sessions}) == 2  # both replicas used
        warm = [r for r in front_records(tmp_path) if r["prompt_tokens"] and r["cached_tokens"]]
        assert len(warm) >= 12  # later turns read their earlier turns from their replica's cache
        health = httpx.get(front.url + "/health", headers={"x-api-key": FRONT_TOKEN}).json()
        assert health["session_moves"] == {} and all(r["in_flight"] == 0 for r in health["replicas"])
    finally:
        front.stop()
        for r in replicas:
            r.stop()


def test_killed_replica_loses_no_session_for_more_than_one_retry(tmp_path):
    replicas = [EmbeddedReplica(tmp_path, f"r{i}") for i in range(2)]
    front = front_server(tmp_path, "anthropic", [r.url for r in replicas], health_interval_s=0.5)
    try:
        outcomes: list = []
        sessions = [f"kill-{i}" for i in range(6)]
        barrier = threading.Barrier(len(sessions) + 1)
        threads = [
            threading.Thread(target=_turns, args=(front.url, s, 5, outcomes, barrier, 2, 0.6))
            for s in sessions
        ]
        for t in threads:
            t.start()
        barrier.wait(60)  # every session has done two turns
        placed = {r["session_id"]: r["replica"] for r in front_records(tmp_path)}
        victim = Counter(placed.values()).most_common(1)[0][0]
        killer = threading.Thread(target=replicas[int(victim[1:])].stop)
        killer.start()  # mid-run: the other sessions' turns keep flowing
        for t in threads:
            t.join(120)
        killer.join(30)
        failures = Counter(session for session, _, ok in outcomes if not ok)
        assert all(count <= 1 for count in failures.values()), failures
        finished = {(s, turn) for s, turn, ok in outcomes if ok}
        assert finished == {(s, turn) for s in sessions for turn in range(5)}  # no session lost
        moved = [s for s, rep in placed.items() if rep == victim]
        last = {r["session_id"]: r["replica"] for r in front_records(tmp_path) if r.get("status") == 200}
        assert moved and all(last[s] != victim for s in moved)
        health = httpx.get(front.url + "/health", headers={"x-api-key": FRONT_TOKEN}).json()
        assert [r["healthy"] for r in health["replicas"]].count(False) == 1
    finally:
        front.stop()
        for r in replicas:
            r.stop()


def test_session_memory_is_bounded_by_count_and_idle_time(tmp_path, monkeypatch):
    # Session ids come from a client header: a front that kept every id ever sent would grow
    # without end, and balance new sessions by counting dead ones.
    from ikcode.admission import sessions
    from ikcode.upstream import router

    monkeypatch.setattr(sessions, "MAX_SESSIONS", 10)
    replica = EmbeddedReplica(tmp_path)
    app = front_app(tmp_path, "anthropic", [replica.url])
    srv = BackgroundServer(app).start()
    up = app.state.upstream
    body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    try:
        with httpx.Client(timeout=60, headers={"x-api-key": FRONT_TOKEN}) as http:

            def turn(session: str) -> None:
                headers = {"x-claude-code-session-id": session}
                assert http.post(srv.url + "/v1/messages", json=body, headers=headers).status_code == 200

            for i in range(30):
                turn(f"s-{i}")
            assert len(up.router.session_replica) == 10 and len(up.admission.sessions) == 10
            assert http.get(srv.url + "/health").json()["replicas"][0]["sessions"] == 10
            assert list(up.router.session_replica)[-1] == user_session("alice", "s-29")  # most recent kept
            monkeypatch.setattr(router, "SESSION_MEMORY_S", 0.2)
            monkeypatch.setattr(up.admission, "config", replace(up.admission.config, session_memory_s=0.2))
            time.sleep(0.3)
            turn("s-new")
            new = [user_session("alice", "s-new")]  # alice: the front's one token
            assert list(up.router.session_replica) == new and list(up.admission.sessions) == new
            assert http.get(srv.url + "/health").json()["replicas"][0]["sessions"] == 1
    finally:
        srv.stop()
        replica.stop()


def test_the_startup_line_shows_replica_urls_without_credentials():
    """It goes to server.log and to `ikcode up`'s progress line."""
    from ikcode.gateway import GatewaySettings
    from ikcode.profiles import load_profile
    from ikcode.upstream.profile import upstream_app

    profile = load_profile("vllm")
    profile = profile.model_copy(
        update={"upstream": {**profile.upstream, "urls": ["https://bob:hunter2@gpu.example/v1?key=SECRET"]}}
    )
    _, what = upstream_app(profile, GatewaySettings(served_model="served-model", context_window=131072))
    assert "gpu.example/v1" in what
    assert "hunter2" not in what and "SECRET" not in what and "bob" not in what
