"""The simulated bench: synthetic agents against a SimulatedServer, in virtual time."""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Mapping
from typing import Any

from ikcode.admission import AdmissionConfig
from ikcode.cache.stats import merge_stats
from ikcode.engines.base import EngineOverloaded

from .hardware import HardwareModel
from .rank import SimRequest
from .results import TurnResult, summarize
from .server import SimulatedServer
from .workload import AgentScript, AgentsWorkload, Turn

Progress = Callable[[float, int], None]  # (virtual seconds, turns done)


def run_simulation(
    hardware: HardwareModel,
    admission: AdmissionConfig,
    workload: AgentsWorkload,
    block_size: int = 2048,
    cache_policy: str = "lru",
    progress: Progress | None = None,
    engine_schedule: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Run the workload to its end (all started turns drained); return the bench report.
    `engine_schedule`: the engine step settings ikcode's adapter passes live (SimulatedServer)."""
    server = SimulatedServer(hardware, admission, block_size, cache_policy, engine_schedule)
    scripts = [AgentScript(workload, i) for i in range(workload.agents)]
    events: list[tuple[float, int, Turn, TurnResult | None]] = []  # (time, seq, turn, result of a retry)
    results: list[TurnResult] = []
    seq = 0

    def schedule(at: float, turn: Turn, result: TurnResult | None = None) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (at, seq, turn, result))

    for script in scripts:
        schedule(*_first(script))

    def finished(req: SimRequest, turn: Turn, result: TurnResult) -> None:
        result.finished_at = req.finished_at
        if req.failed:
            result.failed = True
            result.error = req.failed
        result.output_tokens = req.output_tokens
        nxt = scripts[turn.agent].next_turn(turn, server.now)
        if nxt is not None:
            schedule(nxt.at, nxt)

    def send(at: float, turn: Turn, result: TurnResult | None) -> None:
        if result is None:
            result = TurnResult(turn.agent, turn.conversation, turn.step, at, turn.prompt_tokens)
            results.append(result)
        req = SimRequest(
            request_id=f"a{turn.agent}-c{turn.conversation}-s{turn.step}-{result.attempts}",
            conversation=turn.conversation,
            prompt_tokens=turn.prompt_tokens,
            output_tokens=turn.output_tokens,
            arrived_at=at,
            session_id=f"agent-{turn.agent}-{turn.conversation}",
        )

        def first(r: SimRequest) -> None:
            assert r.first_token_at is not None
            result.ttft_s = r.first_token_at - result.sent_at
            result.cached_tokens = r.prompt_tokens - r.computed

        req.on_first_token = first
        req.on_finished = lambda r: finished(r, turn, result)
        try:
            server.submit(req)
        except EngineOverloaded as err:
            if result.attempts >= workload.max_attempts:
                result.failed = True
                result.error = str(err)
                nxt = scripts[turn.agent].next_turn(turn, at)
                if nxt is not None:
                    schedule(nxt.at, nxt)
                return
            result.attempts += 1
            schedule(at + err.retry_after_s, turn, result)

    wall = time.perf_counter()
    last_report = 0.0
    while events or not server.idle:
        horizon = events[0][0] if events else float("inf")
        if server.idle:
            server.now = max(server.now, horizon)
        else:
            server.step(horizon)
        while events and events[0][0] <= server.now:
            at, _, turn, result = heapq.heappop(events)
            send(at, turn, result)
        if progress is not None and server.now - last_report >= 120.0:
            last_report = server.now
            progress(server.now, sum(1 for r in results if r.finished_at is not None))

    end = max((r.finished_at or r.sent_at for r in results), default=0.0)
    start = min((r.sent_at for r in results), default=0.0)
    config = {
        "mode": "simulate",
        "policy": admission.policy,
        "hardware": hardware.name,
        "engine_schedule": {
            key: getattr(server.hw, key)
            for key in ("max_num_batched_tokens", "prefill_attempt_interval", "prefill_any_attempt_interval")
        },
        "block_size": block_size,
        "cache_policy": cache_policy,
        "workload": workload.to_dict(),
        "admission": dict(admission.__dict__),
    }
    report = summarize(results, end - start, config)
    report["no_cache_read_tokens_per_s"] = hardware.cold_read_tokens_per_s()
    report["admission"] = server.policy.stats()
    report["cache"] = _merged_cache_stats(server)
    report["ranks"] = [
        {
            "rank": r.index,
            "kv_blocks": r.total_blocks,
            "copied_tokens": r.copied_tokens,
        }
        for r in server.ranks
    ]
    report["simulator"] = {
        "steps": server.steps,
        "prefill_steps": server.prefill_steps,
        "wall_s": time.perf_counter() - wall,
        "busy_s": server.busy_s,
    }
    return report


def _merged_cache_stats(server: SimulatedServer) -> dict[str, float]:
    return merge_stats([rank.cache.stats.to_dict() for rank in server.ranks])


def _first(script: AgentScript) -> tuple[float, Turn]:
    turn = script.first_turn()
    return turn.at, turn
