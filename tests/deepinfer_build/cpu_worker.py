"""The GPU half of a DeepInfer worker, on a CPU: cache memory, the forward, the sampler.

DeepInfer's Worker (worker/worker.py) keeps its step loop; CpuWorker replaces only what
worker/base.py does with the GPU (see cpu_runtime's docstring). The model reads the KV pages of a
sequence through its block table (the patched `Sequence.block_table` binding) and the sliding
window from its state slot, so its tokens are right only when the pages and the window are.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .cpu_runtime import (
    BLOCK_TOKENS,
    ENV_BLOCKS,
    ENV_EOS_AFTER,
    ENV_FAIL_STATE_READ,
    ENV_STEP_SECONDS,
    ENV_WINDOW,
    EXTRA_STATE_TOKENS,
    kv_value,
    special_tokens,
)

FIRST_WORD = 3  # the CPU model never emits ids below this (BOS, EOS and the tokenizers' specials)
MOD = 1_000_003


class CpuModel:
    """The model class DeepInfer looks up (llm_engine.py:204): no multimodal mapper."""


def _window() -> int:
    return int(os.environ.get(ENV_WINDOW, "128"))


def _ring() -> int:
    return _window() + EXTRA_STATE_TOKENS


def _make_cache_interface(base: type) -> type:
    class CpuCacheInterface(base):  # type: ignore[misc, valid-type]
        """GPUCacheInterface with its two state-slice kernels on the CPU (cache_engine.py:762-848)."""

        @classmethod
        def select_state_slice_to_store(
            cls, state_id: int, last_hit_position: int, state_cache: torch.Tensor,
            state_tensor: torch.Tensor | None = None, TO_CE: bool = False,
        ) -> torch.Tensor | None:  # fmt: skip
            if os.environ.get(ENV_FAIL_STATE_READ) == "1":
                raise RuntimeError("select_state_slice failed (fault injected by the test)")
            if not TO_CE:
                assert last_hit_position % BLOCK_TOKENS == 0, last_hit_position
            ring, window = _ring(), _window()
            slots = state_cache.view(torch.int64)[state_id]
            positions = torch.arange(last_hit_position - window, last_hit_position)
            values = torch.where(positions >= 0, slots[positions % ring], torch.zeros_like(positions))
            if state_tensor is None:
                return values.clone()
            state_tensor.copy_(values)
            return state_tensor

        @classmethod
        def load_state_from_store_to_prefill_cache(
            cls, state_id: int, last_hit_position: int, state_tensor: torch.Tensor, state_cache: torch.Tensor
        ) -> None:
            ring, window = _ring(), _window()
            positions = torch.arange(last_hit_position - window, last_hit_position)
            keep = positions >= 0
            state_cache.view(torch.int64)[state_id][positions[keep] % ring] = state_tensor[keep]

    return CpuCacheInterface


class CpuCacheEngine:
    """Cache memory in host RAM with CacheEngine's names (cache_engine.py:851-978): gpu_blocks is
    [num_blocks, bytes] (a page per row), gpu_states [num_state_slots, bytes], gpu_cache the
    GPUCacheInterface."""

    def __init__(self, num_blocks: int, num_state_slots: int):
        from deepinfer.worker.cache_engine import GPUCacheInterface

        self.gpu_blocks = torch.zeros(num_blocks, BLOCK_TOKENS * 8, dtype=torch.uint8)
        self.gpu_states = torch.zeros(num_state_slots, _ring() * 8, dtype=torch.uint8)
        interface = _make_cache_interface(GPUCacheInterface)
        # Its __init__ lays out the V4.1 KV formats (tilelang's, cache_engine.py:586-640); only the
        # two classmethods are used on this path.
        self.gpu_cache = interface.__new__(interface)

    def pages(self) -> torch.Tensor:
        return self.gpu_blocks.view(torch.int64)  # [num_blocks, 128]

    def rings(self) -> torch.Tensor:
        return self.gpu_states.view(torch.int64)  # [num_state_slots, ring]


class CpuModelRunner:
    """execute_main_model / execute_sample / post_process of ModelRunner (model_runner.py:308-384)."""

    use_cuda_graph = False

    def __init__(self, vocab_size: int, eos: int):
        self.vocab_size = vocab_size
        self.eos = eos
        self.cache: CpuCacheEngine | None = None
        self.scheduled: list[Any] = []  # this step's Sequences, in seq_metadata_list order
        self.last_sampled: dict[str, int] = {}  # ZOS: a decode input not yet in the CPU-side tokens
        self.forward_tokens = 0  # tokens run through the model (prefill and decode)

    def _placeholder_seq_metadata(self, is_prompt: bool) -> Any:
        from deepinfer.worker.model_runner import ModelRunner

        return ModelRunner._placeholder_seq_metadata(self, is_prompt)

    def execute_main_model(self, seq_metadata_list: list[Any], kv_caches: Any, metadata_zos: Any = None,
                           total_q: int | None = None) -> Any:  # fmt: skip
        from types import SimpleNamespace

        next_tokens: list[int] = []
        real = [m for m in seq_metadata_list if not m.is_placeholder]
        if real:  # a step as long as a real card's (e.g. a 128K-token prefill chunk)
            time.sleep(float(os.environ.get(ENV_STEP_SECONDS, "0")))
        assert len(real) == len(self.scheduled) or not real, (len(real), len(self.scheduled))
        for meta, seq in zip(real, self.scheduled, strict=False):
            assert meta.request_id == seq.request_id
            next_tokens.append(self._forward(meta, seq))
        return SimpleNamespace(model_output=next_tokens, input_metadata=None, graph_size=0)

    def _forward(self, meta: Any, seq: Any) -> int:
        """Run positions [k - q, k). Like attention over a sliding window, what is stored for a
        position depends on the window [p - W, p) read from the state slot's ring, so positions
        replayed after a resume come out right only if the restored window is. The next token then
        reads every stored entry of [0, k) through the block table."""
        assert self.cache is not None
        pages = self.cache.gpu_blocks.numpy().view(np.int64)  # [num_blocks, 128], shared memory
        slots = self.cache.gpu_states.numpy().view(np.int64)
        k, q = int(meta.seqlen_k), int(meta.seqlen_q)
        tokens = list(seq.data.get_token_ids())
        if len(tokens) < k:  # zero-overhead scheduling: the last sampled token is not on the CPU yet
            tokens.append(self.last_sampled[seq.request_id])
        assert len(tokens) >= k, (seq.request_id, len(tokens), k)
        table = list(seq.block_table)
        ring_len, window = _ring(), _window()
        ring = slots[int(seq.state_id)]
        start = k - q
        before = np.arange(max(0, start - window), start)
        win = int(((ring[before % ring_len] % MOD) * (before % 31 + 1)).sum())  # window sum at `start`
        for p in range(start, k):
            value = int(kv_value(tokens[p], p)) + win % MOD
            pages[table[p // BLOCK_TOKENS], p % BLOCK_TOKENS] = value
            ring[p % ring_len] = value
            win += (value % MOD) * (p % 31 + 1)
            if p - window >= 0:  # slide: the entry leaving the window, read back from the ring
                gone = p - window
                win -= (int(ring[gone % ring_len]) % MOD) * (gone % 31 + 1)
        self.forward_tokens += q
        rows = np.asarray([table[i // BLOCK_TOKENS] for i in range(0, k, BLOCK_TOKENS)], dtype=np.int64)
        kv = pages[rows].reshape(-1)[:k]
        full = int(((kv % MOD) * (np.arange(k) % 97 + 1)).sum())
        token = FIRST_WORD + (full * 31 + win * 17 + k) % (self.vocab_size - FIRST_WORD)
        eos_after = int(os.environ.get(ENV_EOS_AFTER, "0"))
        if eos_after and k - seq.get_prompt_len() + 1 >= eos_after:
            token = self.eos
        return token

    def execute_sample(self, seq_metadata_list: list[Any], input_metadata: Any, model_output: Any,
                       kv_caches: Any) -> Any:  # fmt: skip
        from deepinfer.sequence import SamplerOutput

        tokens = model_output.move()
        real = [m for m in seq_metadata_list if not m.is_placeholder]
        out = SamplerOutput()
        final: list[int] = []
        for meta, token in zip(real, tokens, strict=True):
            # a prompt chunk that is not the last one samples nothing the engine keeps
            if not meta.is_prompt or meta.is_last_prompt_chunk:
                self.last_sampled[meta.request_id] = token
            final.append(token)
        out.sampled_token.token_ids = torch.tensor(final or [0] * len(seq_metadata_list), dtype=torch.int32)
        out.sampled_token.token_logprobs = torch.zeros(len(out.sampled_token.token_ids), dtype=torch.float32)
        out.post_funcs = []
        return out

    def post_process(self, seq_metadata_list: list[Any], sampler_output: Any, is_prompt: bool) -> None:
        for f in sampler_output.post_funcs:
            f()
        sampler_output.post_funcs.clear()

    def destroy_cuda_graphs(self) -> None:
        pass


def make_worker_class(base: type) -> type:
    """DeepInfer's Worker with the GPU setup of WorkerBase replaced (worker/base.py:56-279)."""
    from deepinfer import envs
    from deepinfer.worker.base import WorkerBase
    from deepinfer.worker.cache_engine import get_num_state_slots

    class CpuWorker(base):  # type: ignore[misc, valid-type]
        def __init__(self, engine_type: Any, model_config: Any, parallel_config: Any, scheduler_config: Any,
                     cache_config: Any, local_rank: int, cp_rank: int, distributed_init_method: str,
                     is_driver_worker: bool = False, engine_callbacks: Any = None) -> None:  # fmt: skip
            # Worker.__init__'s own fields (worker.py:70-73), then WorkerBase's without the GPU.
            self.engine_callbacks = engine_callbacks
            self.prev_step_state = None
            self.nextn = envs.DEEPINFER_USE_NEXTN_DECODE
            self.engine_type = engine_type
            self.model_config = model_config
            self.parallel_config = parallel_config
            self.scheduler_config = scheduler_config
            self.cache_config = cache_config
            self.local_rank = local_rank
            self.dp_rank = parallel_config.data_parallel_rank
            self.cp_rank = cp_rank
            self.global_rank = parallel_config.engine_rank * parallel_config.context_parallel_size + cp_rank
            self.distributed_init_method = distributed_init_method
            self.is_driver_worker = is_driver_worker
            eos = special_tokens(model_config.model)["eos_token_id"]
            self.model_runner = CpuModelRunner(model_config.get_vocab_size(), eos)
            self.cache_engine: CpuCacheEngine | None = None
            self.gpu_cache = None
            self.step = 0
            self.gc_interval_step = envs.DEEPINFER_GC_INTERVAL_STEP
            self.decode_perf_curve: list[Any] = []
            self.init_dist()  # DeepInfer's: gloo init_process_group + init_parallel_groups

        def load_model(self, skip_load: bool = False) -> None:
            pass

        def profile_num_available_blocks(self) -> int:
            self.cache_config.num_gpu_blocks = int(os.environ.get(ENV_BLOCKS, "64"))
            return self.cache_config.num_gpu_blocks

        def init_cache_engine(self) -> None:
            slots = get_num_state_slots(self.model_config.max_num_seqs)
            self.cache_engine = CpuCacheEngine(self.cache_config.num_gpu_blocks, slots)
            self.model_runner.cache = self.cache_engine
            self.gpu_cache = self.cache_engine.gpu_cache
            # what CacheEngine reports back (cache_engine.py:949-951)
            self.cache_config.bytes_of_state_per_seqs = self.cache_engine.gpu_states.size(-1)
            self.cache_config.num_state_seqs = slots
            self.cache_config.bytes_per_block = self.cache_engine.gpu_blocks.size(-1)

        def warm_up_model(self, *, capture_max_graph_only: bool = False) -> None:
            self.decode_perf_curve = []

        def execute_model_step(self, is_prompt: bool, is_placeholder: bool, seq_metadata_list: Any = None,
                               scheduler_outputs: Any = None) -> Any:  # fmt: skip
            self.model_runner.scheduled = list(scheduler_outputs.scheduled_seqs) if scheduler_outputs else []
            return super().execute_model_step(is_prompt, is_placeholder, seq_metadata_list, scheduler_outputs)

        def _correct_seqlens_qk(self, seq_metadata_list: Any, is_prompt: bool, total_q: int) -> None:
            # worker.py:186-245 moves seqlens to the GPU and fixes them with tilelang kernels when
            # multi-token prediction is on; without it (nextn = 0) there is nothing to correct, and
            # the CPU model takes the lagging decode input from last_sampled instead.
            return None

        def stop(self) -> None:
            if dist.is_initialized():
                dist.barrier()
                dist.destroy_process_group()

    assert issubclass(CpuWorker, WorkerBase)
    return CpuWorker
