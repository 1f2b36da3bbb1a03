"""One OpenMP team in the process: the engine thread's.

torch's CPU kernels split their work over an OpenMP team, and libgomp gives every thread that
starts a parallel region a team of its own. Once the teams' threads outnumber the CPUs, libgomp
stops letting idle workers spin (its "throttled" spin count) and they sleep: every parallel region
then begins by waking a sleeping thread. The embedded engine runs on its own thread, after the
caller (the server's main thread, a bench, a test) has loaded the model with torch ops of its own,
so it paid that wake-up in every kernel. Measured with torch 2.13 on two cores: a 200K-element add
13 us from a lone thread, 47 us from a second thread once the first had run one parallel op;
SmolLM2-135M's int8 decode matmuls (120 a step) 4.1 ms from a lone thread, 9.0 ms from the second.

So the thread that builds an engine gives up its parallelism (one torch thread: its ops run
inline, it never starts a team), and the engine thread takes the count the caller had.
"""

from __future__ import annotations

import torch

_callers_count: int | None = None  # the caller's torch thread count before it was lowered


def hand_threads_to_engine(requested: int | None) -> int:
    """Lower the calling thread to one torch thread; return the count the engine thread should set
    (`requested`, else what the first engine's caller had: torch's default or its own setting)."""
    global _callers_count
    if _callers_count is None:
        _callers_count = torch.get_num_threads()
    torch.set_num_threads(1)
    return requested or _callers_count
