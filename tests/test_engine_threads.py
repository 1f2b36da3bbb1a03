"""The engine thread is the one thread that runs torch's kernels multi-threaded (threads.py): the
thread that builds an engine is left with one torch thread, the engine thread gets the count asked
for. Two threads with OpenMP teams of their own on two cores put libgomp's idle workers to sleep,
and every kernel of the engine then starts by waking one."""

from __future__ import annotations

import threading

import pytest
import torch

from ikcode.engines.base import EngineRequest, LifecycleKind, SamplingParams
from tests.tiny_model import tiny_engine


def test_the_builder_gives_its_threads_to_the_engine_thread():
    seen: dict[str, int] = {}
    built = threading.Event()

    def build() -> None:  # a thread of its own: the test leaves pytest's thread as it was
        torch.set_num_threads(2)
        engine = tiny_engine(num_threads=2)
        seen["builder"] = torch.get_num_threads()
        engine.add_listener(
            lambda e: (
                seen.setdefault("engine", torch.get_num_threads())
                if e.kind is LifecycleKind.FIRST_TOKEN
                else None
            )
        )
        tokens, final = engine.submit(EngineRequest("r", [5, 6, 7], SamplingParams(max_tokens=2))).collect(30)
        seen["tokens"] = len(tokens)
        engine.shutdown()
        built.set()

    worker = threading.Thread(target=build)
    worker.start()
    worker.join(60)
    assert built.is_set()
    assert seen == {"builder": 1, "engine": 2, "tokens": 2}


def test_a_thread_count_below_one_is_refused_when_built():
    # The engine thread sets it as it starts: a bad count there would kill the thread silently.
    for bad in (0, -1):
        with pytest.raises(ValueError, match="num_threads"):
            tiny_engine(num_threads=bad, start=False)
