"""One OpenMP team per engine: its thread's, and no other thread's beside it.

torch's CPU kernels split their work over an OpenMP team, and libgomp gives every thread that
starts a parallel region a team of its own. Once the teams' threads outnumber the CPUs, libgomp
stops letting idle workers spin (its "throttled" spin count) and they sleep: every parallel region
then begins by waking a sleeping thread. The embedded engine runs on its own thread, after the
caller (the server's main thread, a bench, a test) has loaded the model with torch ops of its own,
so it paid that wake-up in every kernel. Measured with torch 2.13 on two cores: a 200K-element add
13 us from a lone thread, 47 us from a second thread once the first had run one parallel op;
SmolLM2-135M's int8 decode matmuls (120 a step) 4.1 ms from a lone thread, 9.0 ms from the second.

So the thread that builds an engine gives up its parallelism (one torch thread: its ops run
inline), and the engine thread takes the count the caller had. Lowering a thread does not end a
team it has already started (its workers live on, counted): call `hand_threads_to_engine` before
the thread's first parallel op, i.e. before loading the model (ikcode/stack.py does); the engine
calls it again when built, which then only returns the count.
"""

from __future__ import annotations

import torch

_callers_count: int | None = None  # the caller's torch thread count before it was lowered


def hand_threads_to_engine(requested: int | None) -> int:
    """Lower the calling thread to one torch thread; return the count the engine thread should set:
    `requested`, else the count of the first thread in the process that called this (torch's
    default or that thread's own setting), remembered here."""
    global _callers_count
    if _callers_count is None:
        _callers_count = torch.get_num_threads()
    torch.set_num_threads(1)
    return requested or _callers_count
