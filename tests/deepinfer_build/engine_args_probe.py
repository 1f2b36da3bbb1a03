"""Run in a process of its own (deepinfer reads its environment at import): the EngineArgs the
adapter builds for one rank, through DeepInfer's own create_engine_configs, and a stall-guard
allocation handed back and taken again on DeepInfer's real scheduler. Prints one JSON line.

    python -m tests.deepinfer_build.engine_args_probe MODEL_DIR DATA_PARALLEL_SIZE
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from ikcode.engines.deepinfer.config import DeepInferConfig
from ikcode.engines.deepinfer.rank import engine_args
from tests.deepinfer_build import cpu_backend, cpu_runtime


def main() -> None:
    model, ranks = sys.argv[1], int(sys.argv[2])
    config = DeepInferConfig(
        model=model, data_parallel_size=ranks, max_model_len=4000, max_num_seqs=8,
        max_num_batched_tokens=8192, backend=cpu_backend.SWITCH,
        environment={cpu_runtime.ENV_BLOCKS: "96", cpu_runtime.ENV_WINDOW: "128"},
        engine_args={"stop_preempted_request": False},  # a profile that tries to turn it off
    )  # fmt: skip
    os.environ.update(config.process_environment(0))
    backend = cpu_backend.load()
    _, _, parallel, scheduler = backend.EngineArgs(**engine_args(config, 0)).create_engine_configs()
    out = {
        "expert_parallel_size": parallel.expert_parallel_size,
        "data_parallel_size": parallel.data_parallel_size,
        "stop_preempted_request": bool(scheduler.stop_preempted_request),
    }
    if ranks == 1:  # the stall guard's hand-back and retry, as rank_admission does it
        engine = backend.LLMEngine.from_engine_args(backend.EngineArgs(**engine_args(config, 0)))
        params = backend.SamplingParams(temperature=0.0, max_tokens=4)
        seq = engine.add_request("u", "r1", params, np.arange(5, 300, dtype=np.int32), enqueue=False)
        first = engine.scheduler.try_allocate_seq(seq)
        engine.scheduler.free_seq(seq)
        out["state_id_after_free"] = seq.state_id
        seq.state_id = -1
        out["retry_allocated"] = bool(engine.scheduler.try_allocate_seq(seq)) and first
        engine.scheduler.free_seq(seq)
        out_of_range = np.array([10**9], dtype=np.int32)
        out["refused_prompt"] = engine.add_request("u", "r2", params, out_of_range, enqueue=False) is None
    print(json.dumps(out), flush=True)
    os._exit(0)  # deepinfer's process groups and threads need no orderly exit here


if __name__ == "__main__":
    main()
