"""Sizing and building the embedded engine's KV pools: the device (and optional host) tensors the
model runner allocates, and the prefix cache that indexes them.

The byte budgets in EmbeddedEngineConfig are ceilings: they are turned into whole blocks here,
and checked again against the tensors actually allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ikcode.cache import PrefixCache, blocks_for_budget, kv_bytes_per_block
from ikcode.engines.embedded.config import EmbeddedEngineConfig
from ikcode.engines.embedded.host_kv import HostKV
from ikcode.engines.embedded.model_runner import ModelRunner
from ikcode.model.config import ModelConfig


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        # A definite index: the engine thread's current device may not be the one that was
        # current here, and its tensors must land next to the pool.
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass
class KVPools:
    runner: ModelRunner
    cache: PrefixCache
    num_blocks: int  # device blocks


def build_kv_pools(
    model_config: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    config: EmbeddedEngineConfig,
    device: torch.device,
) -> KVPools:
    mc = model_config
    bs = config.block_size
    block_bytes = kv_bytes_per_block(mc.num_layers, mc.num_kv_heads, mc.head_dim, bs, dtype_bytes=4)
    num_blocks = blocks_for_budget(bs, bytes_budget=config.kv_memory_bytes, bytes_per_block=block_bytes)
    if num_blocks < 2:
        raise ValueError(
            f"kv_memory_bytes={config.kv_memory_bytes} holds {num_blocks} blocks of "
            f"{block_bytes} bytes; at least 2 are needed"
        )
    host_budget = config.host_kv_memory_bytes
    num_host = 0
    if host_budget:
        num_host = blocks_for_budget(bs, bytes_budget=host_budget, bytes_per_block=block_bytes)
    # CUDA: the tier's page-locked staging buffers come out of the same budget (host_kv.py).
    staging = min(config.tier_staging_blocks, num_host // 2) if device.type == "cuda" and num_host else 0
    if staging:
        layer_block = (mc.num_layers, bs, mc.num_kv_heads, mc.head_dim)
        left = host_budget - HostKV.staging_reserved_bytes(layer_block, staging, pinned=True)
        num_host = blocks_for_budget(bs, bytes_budget=max(0, left), bytes_per_block=block_bytes)
        if num_host < 1:  # too small a tier to stage: direct copies
            staging = 0
            num_host = blocks_for_budget(bs, bytes_budget=host_budget, bytes_per_block=block_bytes)
    runner = ModelRunner(
        mc,
        state_dict,
        num_blocks,
        num_host,
        bs,
        device,
        config.batch_invariance,
        config.weights,
        config.float_weights,
        staging,
        config.fp32_gemm,
    )
    # A tier's budget is a ceiling: check it against the tensors actually allocated.
    for tier, used, budget in (
        ("device", runner.device_kv_bytes, config.kv_memory_bytes),
        ("host", runner.host_kv_bytes, config.host_kv_memory_bytes),
    ):
        if used > budget:
            raise RuntimeError(f"{tier} KV tensors take {used} bytes, over the {budget}-byte budget")
    cache = PrefixCache(
        num_blocks,
        bs,
        num_host,
        store=runner if num_host else None,
        policy=config.cache_policy,
        write_through=config.host_write_through,
        bytes_per_block=runner.device_kv_bytes // num_blocks,  # measured
    )
    return KVPools(runner, cache, num_blocks)
