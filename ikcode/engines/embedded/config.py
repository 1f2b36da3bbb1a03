"""Settings of the embedded engine (one dataclass, no ceremony)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class EmbeddedEngineConfig:
    kv_memory_bytes: int = 256 * 1024 * 1024  # device KV pool; the block count is derived from it
    host_kv_memory_bytes: int = 0  # host tier for evicted blocks (0 = none)
    # Copy each block to the host tier when it is committed, so that evicting it from the device
    # later costs no copy (a block already on the host is dropped from the device for free).
    host_write_through: bool = False
    # On CUDA, tier copies go through a page-locked staging buffer of this many blocks, paid for out
    # of host_kv_memory_bytes (host_kv.py says why). Unused on CPU.
    tier_staging_blocks: int = 64
    block_size: int = 16
    max_num_seqs: int = 8
    max_prefill_tokens_per_step: int = 512  # chunked-prefill token budget per engine step
    # A prefill too long to finish in one step runs at most this many tokens a step. A request
    # that arrives during a step waits for the step to end, and every decode token with it: this
    # bounds how long a warm turn waits behind a cold prompt's chunk.
    long_prefill_chunk_tokens: int = 256
    # torch threads of the engine thread (threads.py); None: the count the first thread to build an
    # engine in this process had.
    num_threads: int | None = None
    device: str = "auto"  # "cpu", "cuda", "cuda:N" or "auto" (cuda when present)
    model_name: str | None = None  # served name; default: the ModelConfig's name
    # Which requests get numbers that never depend on what else is in the batch (their prompt rows
    # in matmuls of a multiple of 4 rows, each decode row run as a one-token prompt chunk;
    # see ikcode/model/llama.py): "all", "greedy" (temperature 0: the quality gate's cached ==
    # cold check, reproducible answers) or "off". Other decode rows share one matmul per weight
    # and one attention call: the weights are read once per step for all of them.
    batch_invariance: Literal["all", "greedy", "off"] = "greedy"
    # "int8" / "int4": the decode rows that share a matmul read int8 copies of the weights (a
    # quarter of fp32's bytes; ikcode/model/int8.py) or 4-bit ones in groups of 32 (5 bits a
    # weight with the group's scale and zero, about a sixth; int4.py: a Q4_1 GGUF's own blocks),
    # CPU only; prompts and batch-invariant rows keep the float weights below.
    weights: Literal["fp32", "int8", "int4"] = "fp32"
    # The weights of every other matmul row (prompts, batch-invariant decode rows): "bf16" halves
    # the bytes and, on a CPU with AVX512-BF16 or AMX, runs prompt matmuls ~2x faster (llama.py);
    # "auto": bf16 on such a CPU, else fp32. A token's numbers still never depend on the batch.
    float_weights: Literal["fp32", "bf16", "auto"] = "fp32"
    # Whose GEMM multiplies fp32 float weights on a CPU: oneDNN's (weights repacked for it; faster
    # than MKL's from 4 rows up, bench/onednn_matmul.py) or MKL's (torch.mm). Either way a row's
    # numbers never depend on the batch; oneDNN falls back to MKL where it cannot run right.
    fp32_gemm: Literal["onednn", "mkl"] = "onednn"
    cache_policy: str = "lru"
    idle_wait_s: float = 0.05  # how long the idle engine thread sleeps between inbox checks

    def validate(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 (or None), got {self.num_threads}")
        if self.tier_staging_blocks < 0:
            raise ValueError(f"tier_staging_blocks must be >= 0, got {self.tier_staging_blocks}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_prefill_tokens_per_step <= 0:
            raise ValueError("max_prefill_tokens_per_step must be >= 1")
        if self.long_prefill_chunk_tokens <= 0:
            raise ValueError("long_prefill_chunk_tokens must be >= 1")
        if self.batch_invariance not in ("all", "greedy", "off"):
            raise ValueError(f"batch_invariance must be all, greedy or off, got {self.batch_invariance!r}")
        if self.float_weights not in ("fp32", "bf16", "auto"):
            raise ValueError(f"float_weights must be fp32, bf16 or auto, got {self.float_weights!r}")
        if self.fp32_gemm not in ("onednn", "mkl"):
            raise ValueError(f"fp32_gemm must be onednn or mkl, got {self.fp32_gemm!r}")
        if self.weights not in ("fp32", "int8", "int4"):
            raise ValueError(f"weights must be fp32, int8 or int4, got {self.weights!r}")
