"""One side of a side-by-side bench in a process of its own.

torch and llama.cpp (or transformers) in one process share one libgomp (torch loads its copy
first; llama.cpp's `libgomp.so.1` resolves to it). Each thread that runs parallel kernels gets an
OpenMP team of its own, and once the teams' threads outnumber the cores libgomp puts idle workers
to sleep: every parallel region of both sides then starts by waking one (ikcode/engines/embedded/
threads.py has the measured cost). Side by side in one process, each side would be measured
slowed by the other. Runs still alternate, one side at a time, so background load hits both.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

_side: Any = None  # the side object, in the child


def _build(factory: Callable[..., Any], args: tuple) -> None:
    global _side
    _side = factory(*args)


def _call(method: str, args: tuple) -> Any:
    return getattr(_side, method)(*args)


class SideProcess:
    """`factory(*args)` built in a spawned child; `call(name, ...)` runs its method there."""

    def __init__(self, factory: Callable[..., Any], *args: Any):
        # One worker: every call goes to the process that built the side. Built by a call, not an
        # initializer, so that a failure comes back here with its traceback.
        self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        try:
            self._pool.submit(_build, factory, args).result()
        except BaseException:
            self._pool.shutdown()
            raise

    def call(self, method: str, *args: Any) -> Any:
        return self._pool.submit(_call, method, args).result()

    def close(self) -> None:
        self._pool.shutdown()
