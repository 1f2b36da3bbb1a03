"""Admission in front of upstream replicas: ikcode's AdmissionPolicy, fed by what the front knows.

An upstream's cache cannot be asked before sending, so a request's class comes from the front's
own memory: a session last sent to the same replica, whose messages extend the ones it sent then,
is warm when its new tail is under the cold threshold (the replica still holds the rest, prefix
caching on). Anything else (a new session, a session that moved, an edited history, a long new
tail) is cold, its whole prompt uncached. Token counts are estimated from message bytes,
calibrated by the prompt tokens the upstream reports.

One AdmissionPolicy per replica, so the cold cap, the queue and the prefill rate are each
replica's own: warm turns go first, at most `max_cold_prefills` cold prefills run on a replica at
once (a cold slot frees at the first token), and a new session's cold request whose predicted
wait exceeds `ttft_bound_s` is shed with 529 + retry-after.
"""

from __future__ import annotations

import asyncio
import hashlib
import pickle
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ikcode.admission import AdmissionConfig
from ikcode.admission.policy import AdmissionPolicy, Ticket
from ikcode.admission.sessions import forget_least_recent
from ikcode.engines.base import CacheLookup

from .router import shown_url

_PRIOR_TOKENS_PER_BYTE = 0.3  # JSON-wrapped code and English: ~3.3 bytes per token


@dataclass
class _SessionMemory:
    replica_url: str
    message_hashes: list[bytes]
    last_seen: float  # monotonic time of its last request


def message_fingerprints(messages: list[Any]) -> tuple[list[bytes], list[int]]:
    """One hash and one byte size per message (same message, same serialization, same hash).
    Pickled, not JSON-dumped: ~3x cheaper on a 20K-token conversation, and just as stable for
    the plain dicts and strings a parsed body holds within one process."""
    hashes, sizes = [], []
    for message in messages:
        raw = pickle.dumps(message, protocol=5)
        hashes.append(hashlib.blake2b(raw, digest_size=12).digest())
        sizes.append(len(raw))
    return hashes, sizes


class UpstreamAdmission:
    def __init__(self, config: AdmissionConfig, replica_urls: list[str]):
        self.config = config
        self.policies = {url: AdmissionPolicy(config) for url in replica_urls}
        # Least recently seen first; forgotten after config.session_memory_s or past MAX_SESSIONS
        # (session ids come from a client header: memory must not grow with every id sent).
        self.sessions: OrderedDict[str, _SessionMemory] = OrderedDict()
        self.tokens_per_byte = _PRIOR_TOKENS_PER_BYTE
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self._tickets: dict[str, tuple[str, Ticket]] = {}  # request id -> (replica url, ticket)
        self._timers: dict[str, asyncio.TimerHandle] = {}  # replica url -> its next look (_pump)

    def lookup(
        self, replica_url: str, session_id: str | None, hashes: list[bytes], sizes: list[int], extra: int
    ) -> CacheLookup:
        prompt = max(1, round((sum(sizes) + extra) * self.tokens_per_byte))
        seen = self.sessions.get(session_id) if session_id else None
        if seen is None or seen.replica_url != replica_url:
            return CacheLookup(prompt_tokens=prompt)
        known = len(seen.message_hashes)
        if known > len(hashes) or hashes[:known] != seen.message_hashes:
            return CacheLookup(prompt_tokens=prompt)  # history edited (compaction, rewind)
        tail = round(sum(sizes[known:]) * self.tokens_per_byte)
        return CacheLookup(prompt_tokens=prompt, device_tokens=max(0, prompt - tail))

    async def enter(
        self,
        request_id: str,
        replica_url: str,
        session_id: str | None,
        messages: list[Any],
        extra_bytes: int = 0,
    ) -> Ticket:
        """Wait for this request's turn on its replica; EngineOverloaded when it is shed."""
        policy = self.policies[replica_url]
        hashes, sizes = message_fingerprints(messages)
        now = time.monotonic()
        ticket = policy.make_ticket(
            request_id, self.lookup(replica_url, session_id, hashes, sizes, extra_bytes), now, session_id
        )
        policy.offer(ticket, now)  # raises EngineOverloaded (529 + retry-after)
        if session_id:
            self.sessions[session_id] = _SessionMemory(replica_url, hashes, now)
            self.sessions.move_to_end(session_id)
            self._forget_idle(now)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = waiter
        self._tickets[request_id] = (replica_url, ticket)
        self._pump(replica_url)
        try:
            await waiter
        except BaseException:  # the client left while queued
            policy.remove(request_id)
            self._waiters.pop(request_id, None)
            self.done(request_id)
            raise
        return ticket

    def _forget_idle(self, now: float) -> None:
        forget_least_recent(self.sessions, now, lambda memory: memory.last_seen, self.config.session_memory_s)

    def _pump(self, replica_url: str) -> None:
        policy = self.policies[replica_url]
        now = time.monotonic()
        for ticket in policy.admit(now):
            waiter = self._waiters.pop(ticket.request_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        # A new session waiting for a slot gets one when an idle session's slot frees: with time,
        # not with an event here (a quiet replica sends none). Look again then.
        timer = self._timers.pop(replica_url, None)
        if timer is not None:
            timer.cancel()
        wait_s = policy.next_change_s(now)
        if wait_s is not None:
            loop = asyncio.get_running_loop()
            self._timers[replica_url] = loop.call_later(max(0.01, wait_s), self._pump, replica_url)

    def first_token(self, request_id: str, computed_tokens: int | None = None) -> None:
        """The replica answered: the request's prefill is over (its cold slot frees)."""
        entry = self._tickets.get(request_id)
        if entry is not None and entry[1].request_id in self.policies[entry[0]].inflight:
            self.policies[entry[0]].on_first_token(request_id, time.monotonic(), computed_tokens)
            self._pump(entry[0])

    def done(
        self, request_id: str, served_by: str | None = None, prompt_tokens: int = 0, cached: int | None = None
    ) -> None:
        """Finished or failed. `served_by`: the replica that really answered (the router may have
        moved it); the upstream's reported prompt tokens calibrate the byte estimate."""
        entry = self._tickets.pop(request_id, None)
        if entry is None:
            return
        url, ticket = entry
        if ticket.request_id in self.policies[url].inflight and prompt_tokens:
            computed = prompt_tokens - (cached or 0) if cached is not None else None
            self.policies[url].on_first_token(request_id, time.monotonic(), computed)
        self.policies[url].on_done(request_id, time.monotonic())  # its session's idle time starts now
        if ticket.session_id and served_by and served_by != url:
            memory = self.sessions.get(ticket.session_id)
            if memory is not None:
                memory.replica_url = served_by
        if prompt_tokens and ticket.prompt_tokens:
            measured = self.tokens_per_byte * prompt_tokens / ticket.prompt_tokens
            self.tokens_per_byte = 0.8 * self.tokens_per_byte + 0.2 * measured
        self._pump(url)

    def stats(self) -> dict[str, Any]:
        """Each replica's queue, by its URL as /health shows it (no credentials)."""
        return {shown_url(url): policy.stats() for url, policy in self.policies.items()}
