"""Stand-in for DeepInfer's Sequence and RequestOutput (csrc pybind classes)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"  # marked during post-processing of the step after the final sample
    FREED = "freed"  # free_seq ran: blocks and state slot are back


@dataclass
class StandinSamplingParams:
    """SamplingParams: the default max_tokens is 16 (engine/arg_utils.py:21-114, facts: "Defaults
    to watch"); temperature < 1e-5 is greedy (the stand-in model is greedy in any case)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seq_seed: int | None = None


class Sequence:
    """pybind_sequence.cpp:109-137: num_cached_tokens is settable, cached_hit_tokens and state_id
    are readable; block_table is NOT bound unless the ikcode patch is applied (see
    ikcode/engines/deepinfer/patches/)."""

    block_table_bound = True  # False reproduces an unpatched build (class attribute, as a binding)

    def __init__(self, user_id: str, request_id: str, params: StandinSamplingParams, prompt: np.ndarray):
        self.user_id = user_id
        self.request_id = request_id
        self.sampling_params = params
        self.prompt_len = int(prompt.shape[0])
        self.token_ids: list[int] = [int(t) for t in prompt]
        self.status = SequenceStatus.WAITING
        self.num_cached_tokens = 0  # settable (facts: leftover hooks of the withheld cache system)
        self.cached_hit_tokens = 0
        self.state_id = -1
        self.aborted = False
        self.finish_reason: str | None = None
        self.num_written = 0  # positions whose KV is in the pages
        self.pending_token: int | None = None  # sampled on "device", not yet post-processed
        self._blocks: list[int] = []

    def __getattribute__(self, name: str):
        if name == "block_table" and not type(self).block_table_bound:
            raise AttributeError("'Sequence' object has no attribute 'block_table' (not bound in pybind)")
        return object.__getattribute__(self, name)

    @property
    def block_table(self) -> list[int]:
        return list(self._blocks)  # read-only, as the one-line binding of the patch

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len


class RequestOutput:
    """A pointer to a C++ RequestOutput: valid until the NEXT step() releases it
    (csrc/engine/pybind_output.cpp:12-35). Reading it later raises, as a dangling pointer would."""

    _FIELDS = ("request_id", "prompt_len", "token_id", "finish_reason", "finished", "num_output_tokens")

    def __init__(self, **fields):
        self._data = fields
        self._valid = True

    def __getattr__(self, name: str):
        if name in RequestOutput._FIELDS:
            if not self.__dict__.get("_valid", False):
                raise RuntimeError(f"RequestOutput.{name} read after the next step() released it")
            return self.__dict__["_data"][name]
        raise AttributeError(name)

    def release(self) -> None:
        self._valid = False

    @staticmethod
    def clone(ptr: RequestOutput) -> RequestOutput:
        """pybind_output.cpp:12-35: a copy that outlives the next step."""
        copy = RequestOutput(**{k: getattr(ptr, k) for k in RequestOutput._FIELDS})
        copy.release = lambda: None  # type: ignore[method-assign]
        return copy
