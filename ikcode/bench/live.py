"""The live bench: synthetic agents against a real endpoint over HTTP, streaming.

Each agent is one asyncio task holding one conversation at a time (Messages API, `stream: true`,
its own `X-Claude-Code-Session-Id`). TTFT is what a client sees: from sending the request to
the first `content_block_delta` event. 429/529 answers are retried after their retry-after
(as Claude Code does), and the turn's TTFT counts from its first attempt.

Prompt sizes are in tokens of the served model; text is generated at about 4 characters per
token from a fixed vocabulary, so the counts the server reports (usage) are the truth used in
the report, not our estimate.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from typing import Any

import httpx

from .results import TurnResult, summarize
from .workload import AgentScript, AgentsWorkload, Turn

WORDS = (
    "the function returns a list of files under src where each test checks one path and the "
    "parser reads tokens from the buffer until it finds a newline then calls the handler with "
    "its arguments and logs the result to stderr before the next request starts"
).split()

Progress = Callable[[float, int], None]


def _text(rng: random.Random, tokens: int) -> str:
    # ~1.3 tokens per word for common English words in BPE vocabularies.
    return " ".join(rng.choice(WORDS) for _ in range(max(1, int(tokens / 1.3))))


class _Conversation:
    def __init__(self, agent: int, conversation: int, seed: int):
        self.rng = random.Random(seed * 7919 + conversation)
        self.session_id = f"bench-{seed}-{agent}-{conversation}"
        self.system = f"You are coding agent {agent}. Work through the repository task step by step."
        self.messages: list[dict[str, Any]] = []

    def grow(self, tokens: int) -> None:
        self.messages.append({"role": "user", "content": _text(self.rng, tokens)})


async def _turn(
    client: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    model: str,
    conv: _Conversation,
    turn: Turn,
    result: TurnResult,
    start: float,
    max_attempts: int,
    turn_timeout_s: float,
) -> str:
    body = {
        "model": model,
        "max_tokens": turn.output_tokens,
        "system": conv.system,
        "messages": conv.messages,
        "stream": True,
    }
    hdrs = dict(headers, **{"X-Claude-Code-Session-Id": conv.session_id})
    while True:
        text: list[str] = []
        usage: dict[str, Any] = {}
        stopped = False
        try:
            async with client.stream("POST", url, json=body, headers=hdrs) as resp:
                if resp.status_code in (429, 529) and result.attempts < max_attempts:
                    await resp.aread()
                    result.attempts += 1
                    await asyncio.sleep(_retry_after_s(resp.headers.get("retry-after")))
                    continue
                if resp.status_code != 200:
                    return _failed(result, start, f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                event = ""
                async for line in resp.aiter_lines():
                    # The server's pings reset httpx's read timeout: a wedged engine behind a live
                    # gateway would hold the turn (and the run past --duration) for ever.
                    if time.monotonic() - start - result.sent_at > turn_timeout_s:
                        return _failed(result, start, f"no whole answer within {turn_timeout_s:.0f} s")
                    if line.startswith("event:"):
                        event = line[6:].strip()
                        continue
                    if not line.startswith("data:"):
                        continue
                    data = json.loads(line[5:])
                    if not isinstance(data, dict):
                        return _failed(result, start, f"an event that is not an object: {line[:100]!r}")
                    if event == "message_start":
                        usage.update((data.get("message") or {}).get("usage") or {})
                    elif event == "content_block_delta":
                        if result.ttft_s is None:
                            result.ttft_s = time.monotonic() - start - result.sent_at
                        delta = data.get("delta") or {}
                        text.append(delta.get("text", "") or delta.get("partial_json", "") or "")
                    elif event == "message_delta":
                        # The final usage: for long prompts the gateway reports the cache only
                        # here (message_start carries zeros or a prediction), as Anthropic's does.
                        usage.update({k: v for k, v in (data.get("usage") or {}).items() if v is not None})
                    elif event == "message_stop":
                        stopped = True
                    elif event == "error":
                        return _failed(result, start, json.dumps(data)[:200])
        except (httpx.HTTPError, json.JSONDecodeError) as err:
            return _failed(result, start, f"{type(err).__name__}: {err}")
        if not stopped:
            return _failed(result, start, "the stream ended before message_stop")
        _take_usage(result, usage)
        result.finished_at = time.monotonic() - start
        if result.ttft_s is None:  # an empty answer: first token = end of the stream
            result.ttft_s = time.monotonic() - start - result.sent_at
        return "".join(text)


def _take_usage(result: TurnResult, usage: dict[str, Any]) -> None:
    cached = int(usage.get("cache_read_input_tokens") or 0)
    result.cached_tokens = cached
    result.prompt_tokens = (
        int(usage.get("input_tokens") or 0) + cached + int(usage.get("cache_creation_input_tokens") or 0)
    )
    result.output_tokens = int(usage.get("output_tokens") or 0)


def _failed(result: TurnResult, start: float, error: str) -> str:
    """Mark the turn failed (it ended now: the steady state's start still comes) and give the
    empty reply."""
    result.failed = True
    result.error = error
    result.finished_at = time.monotonic() - start
    return ""


def _retry_after_s(header: str | None) -> float:
    """retry-after in seconds, at most a minute; an HTTP date or nonsense counts as 1 s."""
    try:
        return min(60.0, max(0.0, float(header or "1")))
    except ValueError:
        return 1.0


async def _agent(
    client: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    model: str,
    workload: AgentsWorkload,
    agent: int,
    start: float,
    results: list[TurnResult],
    turn_timeout_s: float,
) -> None:
    script = AgentScript(workload, agent)
    turn: Turn | None = script.first_turn()
    if turn.at >= workload.duration_s:  # a ramp longer than the run: this agent never starts
        turn = None
    conv: _Conversation | None = None
    while turn is not None:
        delay = turn.at - (time.monotonic() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        if turn.step == 0 or conv is None:
            conv = _Conversation(agent, turn.conversation, workload.seed)
            conv.grow(turn.prompt_tokens)
        result = TurnResult(agent, turn.conversation, turn.step, time.monotonic() - start, turn.prompt_tokens)
        results.append(result)
        reply = await _turn(
            client, url, headers, model, conv, turn, result, start, workload.max_attempts, turn_timeout_s
        )
        now = time.monotonic() - start
        # A failed turn still gets an assistant message, so the conversation keeps alternating.
        conv.messages.append({"role": "assistant", "content": reply or "ok"})
        nxt = script.next_turn(turn, now, result.output_tokens or None)
        if nxt is not None and nxt.step > 0:
            conv.grow(max(1, nxt.prompt_tokens - turn.prompt_tokens - (result.output_tokens or 0)))
        turn = nxt


async def run_live_async(
    base_url: str,
    token: str | None,
    workload: AgentsWorkload,
    model: str = "default",
    timeout_s: float = 600.0,
    progress: Progress | None = None,
) -> dict[str, Any]:
    url = base_url.rstrip("/") + "/v1/messages"
    headers = {"anthropic-version": "2023-06-01", "content-type": "application/json"}
    if token:
        headers["x-api-key"] = token
        headers["authorization"] = f"Bearer {token}"
    results: list[TurnResult] = []
    start = time.monotonic()
    limits = httpx.Limits(max_connections=workload.agents + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits) as client:
        tasks = [
            asyncio.create_task(_agent(client, url, headers, model, workload, i, start, results, timeout_s))
            for i in range(workload.agents)
        ]
        pending = set(tasks)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=5.0)
            if progress is not None:
                progress(time.monotonic() - start, sum(1 for r in results if r.finished_at is not None))
        for task in tasks:
            task.result()  # surface bugs in the runner itself
    sent = [r.sent_at for r in results]
    ends = [r.finished_at for r in results if r.finished_at is not None]
    duration = (max(ends) - min(sent)) if ends and sent else 0.0
    config = {"mode": "live", "base_url": base_url, "model": model, "workload": workload.to_dict()}
    return summarize(results, duration, config)


def run_live(
    base_url: str,
    token: str | None,
    workload: AgentsWorkload | None = None,
    model: str = "default",
    timeout_s: float = 600.0,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run the agents against base_url (the gateway's root); return the bench report."""
    workload = workload or AgentsWorkload()
    return asyncio.run(run_live_async(base_url, token, workload, model, timeout_s, progress))
