"""Test helpers: a DeepInferEngine whose rank processes run DeepInfer's real engine core on the CPU."""

from __future__ import annotations

import random
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from ikcode.engines.base import EngineRequest, FinishReason, SamplingParams
from ikcode.engines.deepinfer.config import DeepInferConfig
from ikcode.engines.deepinfer.engine import DeepInferEngine
from tests.deepinfer_build import build, cpu_backend, cpu_runtime


def built_core() -> Path:
    """The cached CPU build of deepinfer._C, or a skip that says exactly why it cannot be had."""
    try:
        return build.build(quiet=True)
    except (build.BuildError, OSError) as err:
        pytest.skip(f"DeepInfer's engine core cannot be built on this machine: {err}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def real_engine(
    tmp_path: Path,
    ranks: int = 1,
    blocks: int = 96,
    window: int = 128,
    vocab: int = cpu_runtime.VOCAB,
    eos: int = cpu_runtime.EOS,
    **overrides: Any,
) -> DeepInferEngine:
    built_core()
    model = cpu_backend.write_model_dir(tmp_path / "model", vocab=vocab, eos=eos)
    port = free_port()
    env = {cpu_runtime.ENV_BLOCKS: str(blocks), cpu_runtime.ENV_WINDOW: str(window)}
    env.update(overrides.pop("environment", {}))
    settings: dict[str, Any] = dict(
        # DeepInfer refuses a max_model_len above 80% of its KV blocks (llm_engine.py:441-450)
        model=str(model), data_parallel_size=ranks, max_model_len=min(65536, blocks * 128 * 8 // 10 - 2),
        max_num_seqs=8,
        max_num_batched_tokens=8192, backend=cpu_backend.SWITCH, master_port=port + 50,
        environment=env, gpu_tier_fraction=0.5, prefill_watermark=0.9, idle_wait_s=0.005,
    )  # fmt: skip
    settings.update(overrides)
    engine = DeepInferEngine(DeepInferConfig(**settings))
    engine.start()
    return engine


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, cpu_runtime.VOCAB) for _ in range(n)]


def run(engine: DeepInferEngine, request_id: str, prompt: list[int], max_tokens: int = 16,
        session: str | None = None, timeout_s: float = 120.0) -> tuple[list[int], Any]:  # fmt: skip
    """Submit, read to the end; (output tokens, final event)."""
    request = EngineRequest(request_id, list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens),
                            session_id=session)  # fmt: skip
    stream = engine.submit(request)
    tokens: list[int] = []
    deadline = time.monotonic() + timeout_s
    for event in stream:
        tokens += event.token_ids
        if event.finished:
            return tokens, event
        assert time.monotonic() < deadline, f"{request_id}: no final event in {timeout_s} s"
    raise AssertionError(f"{request_id}: stream ended without a final event")


def wait_quiet(engine: DeepInferEngine, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Wait until every rank has released everything; then each rank's counts."""
    deadline = time.monotonic() + timeout_s
    while True:
        checks = engine.check()
        # copy sources: blocks copied from, unpinned at the rank's next step once their copies ran
        quiet = ("live", "pending", "engine_unfinished", "blocks_copy_sources")
        if all(c[key] == 0 for c in checks for key in quiet):
            return checks
        assert time.monotonic() < deadline, checks
        time.sleep(0.05)


def assert_no_leaks(checks: list[dict[str, Any]]) -> None:
    """Every block in use is one the cache pins; every state slot is free again."""
    for c in checks:
        assert c["blocks_total"] - c["blocks_free"] == c["blocks_pinned"], c
        assert c["state_slots_free"] == c["state_slots_free_at_start"], c


def finished_normally(event: Any) -> bool:
    return event.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and event.error is None
