"""Which replica serves a request: the session's own replica first, then its prefix's.

A conversation's KV lives on the replica that served its previous turn, so a session stays put
(`X-Claude-Code-Session-Id`). A request without a session id goes where its prefix (system
prompt + first message, stable for a whole conversation) hashes to: rendezvous hashing, so when
a replica leaves only its keys move. A session moves only when its replica is overloaded (the
load guard: `max_in_flight` requests there) and another replica has room, or when its replica
is down; it then sticks to the new one.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from ikcode.admission.sessions import forget_least_recent

# New sessions follow their prefix's replica until it holds this many more sessions than another.
SESSION_SLACK = 2
# A session's replica is remembered this long after its last request (an hour, as admission
# remembers a session: AdmissionConfig.session_memory_s), and for at most this many sessions:
# session ids come from a client header, so memory must not grow with every id ever sent
# (admission.sessions.MAX_SESSIONS).
SESSION_MEMORY_S = 3600.0


@dataclass
class Replica:
    url: str
    index: int
    healthy: bool = True
    in_flight: int = 0
    served: int = 0
    failures: int = 0
    last_error: str = ""
    sessions: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return f"r{self.index}"

    @property
    def shown_url(self) -> str:
        """The URL as health, metrics and logs show it: without the user, password or query a
        replica's URL may carry (`http://user:secret@host/v1?key=...` -> `http://host/v1`)."""
        return shown_url(self.url)


def shown_url(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


_URL = re.compile(r"\w+://[^\s'\"]+")


def without_credentials(text: str) -> str:
    """text (an error message naming a URL) with every URL shown as shown_url shows it: no user,
    password or query."""
    return _URL.sub(lambda match: shown_url(match.group(0)), text)


class NoReplica(Exception):
    """Every replica is down (the client gets a retryable 503)."""


def _score(key: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{url}".encode(), digest_size=8).digest(), "big")


class Router:
    def __init__(self, urls: list[str], max_in_flight: int):
        self.replicas = [Replica(url, i) for i, url in enumerate(urls)]
        self.max_in_flight = max_in_flight
        # session id -> (its replica, when it last sent a request), least recently used first
        self.session_replica: OrderedDict[str, tuple[Replica, float]] = OrderedDict()
        self.moves: Counter[str] = Counter()  # reason -> sessions moved
        self._lock = threading.Lock()

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    def _by_prefix(self, key: str, candidates: list[Replica]) -> Replica:
        return max(candidates, key=lambda r: _score(key, r.url))

    def _place_new(self, prefix_key: str, up: list[Replica]) -> Replica:
        """A new session goes where its prefix hashes, unless that replica is at its in-flight
        limit or already holds clearly more sessions than another (the prefix of a brand-new
        conversation is mostly its own, so spreading sessions costs little cache)."""
        chosen = self._by_prefix(prefix_key, up)
        if chosen.in_flight >= self.max_in_flight:
            return min(up, key=lambda r: (r.in_flight, -_score(prefix_key, r.url)))
        fewest = min(up, key=lambda r: (len(r.sessions), r.in_flight, -_score(prefix_key, r.url)))
        if len(chosen.sessions) > len(fewest.sessions) + SESSION_SLACK:
            return fewest
        return chosen

    def pick(self, session_id: str | None, prefix_key: str, exclude: set[str] = frozenset()) -> Replica:
        """The replica for this request, with its in-flight count already taken (call `release`)."""
        with self._lock:
            up = [r for r in self.replicas if r.healthy and r.url not in exclude]
            if not up:
                raise NoReplica("no healthy upstream replica")
            now = time.monotonic()
            current = self._replica_of(session_id)
            if current is not None and (not current.healthy or current.url in exclude):
                self.moves["replica_down"] += 1
                current = None
            if current is None:
                chosen = self._place_new(prefix_key, up)
            elif current.in_flight >= self.max_in_flight:
                # The load guard: move only to a replica that is clearly less loaded.
                lighter = min(up, key=lambda r: r.in_flight)
                if lighter.in_flight < current.in_flight - 1:
                    self.moves["overloaded"] += 1
                    chosen = lighter
                else:
                    chosen = current
            else:
                chosen = current
            if session_id:
                old = self._replica_of(session_id)
                if old is not chosen:
                    if old is not None:
                        old.sessions.discard(session_id)
                    chosen.sessions.add(session_id)
                self.session_replica[session_id] = (chosen, now)
                self.session_replica.move_to_end(session_id)
            self._forget_idle(now)
            chosen.in_flight += 1
            chosen.served += 1
            return chosen

    def peek(self, session_id: str | None, prefix_key: str) -> Replica | None:
        """Where `pick` would most likely send this request now, taking nothing (admission
        queues it on that replica; a later move by the load guard is rare and tolerated)."""
        with self._lock:
            current = self._replica_of(session_id)
            if current is not None and current.healthy:
                return current
            up = self.healthy()
            return self._place_new(prefix_key, up) if up else None

    def _replica_of(self, session_id: str | None) -> Replica | None:
        entry = self.session_replica.get(session_id) if session_id else None
        return entry[0] if entry is not None else None

    def _forget_idle(self, now: float) -> None:
        """Sessions idle past SESSION_MEMORY_S, or the least recent past MAX_SESSIONS, are
        forgotten (placed anew by their prefix next time, most likely on the same replica)."""
        for session_id, (replica, _) in forget_least_recent(
            self.session_replica, now, lambda entry: entry[1], SESSION_MEMORY_S
        ):
            replica.sessions.discard(session_id)

    def url_of(self, name: str | None) -> str | None:
        return next((r.url for r in self.replicas if r.name == name), None)

    def release(self, replica: Replica) -> None:
        with self._lock:
            replica.in_flight = max(0, replica.in_flight - 1)

    def mark_down(self, replica: Replica, reason: str) -> None:
        """Take a replica out: its sessions are re-routed on their next request."""
        with self._lock:
            if replica.healthy:
                replica.failures += 1
            replica.healthy = False
            replica.last_error = without_credentials(reason)

    def mark_up(self, replica: Replica) -> None:
        with self._lock:
            replica.healthy = True
            replica.last_error = ""

    def snapshot(self) -> list[dict]:
        with self._lock:
            return [
                {
                    "replica": r.name,
                    "url": r.shown_url,
                    "healthy": r.healthy,
                    "in_flight": r.in_flight,
                    "served": r.served,
                    "sessions": len(r.sessions),
                    "failures": r.failures,
                    **({"last_error": r.last_error} if r.last_error else {}),
                }
                for r in self.replicas
            ]
