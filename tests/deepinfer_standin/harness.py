"""Builds the DeepInfer adapter over the stand-in, for tests."""

from __future__ import annotations

import os
import random
import time
import uuid

from ikcode.engines.deepinfer import REQUIRED_ENVIRONMENT, DeepInferConfig, DeepInferEngine

from . import llm_engine as standin_backend
from .llm_engine import EOS_TOKEN_ID, VOCAB_SIZE


def standin_engine(
    ranks: int = 1, num_gpu_blocks: int = 512, max_num_seqs: int = 8, **overrides
) -> DeepInferEngine:
    os.environ.update(REQUIRED_ENVIRONMENT)  # what the adapter sets before importing deepinfer
    values = dict(
        model="standin", data_parallel_size=ranks, max_model_len=32768, max_num_seqs=max_num_seqs,
        eos_token_ids=(EOS_TOKEN_ID,), vocab_size=VOCAB_SIZE, chunked_prefill=4096,
        engine_args={"num_gpu_blocks": num_gpu_blocks, "dist_init_addr": f"standin-{uuid.uuid4().hex}"},
    )  # fmt: skip
    values.update(overrides)
    return DeepInferEngine(DeepInferConfig(**values), backend=standin_backend)


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]


def wait_released(engine: DeepInferEngine, timeout_s: float = 10.0) -> None:
    """Every request released (finalize_seq ran), then: no leaked blocks or state slots."""
    deadline = time.monotonic() + timeout_s
    while not engine.idle():
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle: {[list(w.live) for w in engine.ranks]}")
        time.sleep(0.005)
    time.sleep(0.03)  # let the rank threads finish the iteration they are in
    engine.check_invariants()
    for w in engine.ranks:
        states = w.engine.cache_engine.gpu_states
        assert len(states.free) == states.num_slots, f"rank {w.rank}: state slots leaked"
        assert not w.engine.scheduler.running and not w.engine.scheduler.waiting
