"""The embedded engine on a CUDA device: it serves, its host tier is page-locked with a staging
buffer paid for out of the host budget, and blocks demoted to the host come back byte for byte.
Skipped, saying so, where torch sees no CUDA device."""

from __future__ import annotations

import pytest
import torch

from ikcode.cache import hash_blocks
from tests.test_tiers_engine import BLOCK_BYTES, BS, fill_device, prompt_of, run
from tests.tiny_model import assert_pool_clean, block_bytes, tiny_engine

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False here)"
)


def cuda_engine(**config):
    defaults = dict(device="cuda", kv_memory_bytes=32 * BLOCK_BYTES, host_kv_memory_bytes=128 * BLOCK_BYTES)
    defaults.update(config)
    return tiny_engine(**defaults)


def test_host_tier_is_page_locked_with_its_staging_buffer_inside_the_budget():
    engine = cuda_engine(tier_staging_blocks=16)
    runner = engine.runner
    assert engine.device.type == "cuda" and runner.k_pool.is_cuda
    assert runner.host_pinned and runner.host.staging_blocks == 16
    assert engine.cache.num_host_blocks == 128 - 16
    assert runner.host_kv_bytes == 128 * BLOCK_BYTES  # tier + staging, within host_kv_memory_bytes
    engine.shutdown()


@pytest.mark.parametrize("staging_blocks", [4, 64])
def test_promoted_blocks_are_byte_identical_on_cuda(staging_blocks: int):
    # 4: a 12-block conversation moves in three chunks through the staging buffer.
    engine = cuda_engine(tier_staging_blocks=staging_blocks)
    prefix = prompt_of(1, 200)
    run(engine, "turn1", prefix)
    keys = hash_blocks(prefix, BS)
    before = {k: block_bytes(engine, engine.cache.pool.index[k]) for k in keys}
    fill_device(engine, "other")
    assert engine.lookup(prefix).host_tokens == 200 // BS * BS
    tokens, stats = run(engine, "turn2", prefix + prompt_of(2, 40), max_tokens=8)
    assert stats.cached_tokens_host == 200 // BS * BS and len(tokens) == 8
    for k in keys:
        assert block_bytes(engine, engine.cache.pool.index[k]) == before[k], "promoted KV differs"
    assert_pool_clean(engine)
    engine.shutdown()


def test_quantized_weights_are_refused_politely_on_cuda():
    # int4 / int8 are CPU kernels: the engine keeps its float weights and still serves.
    engine = cuda_engine(weights="int4")
    assert engine.runner.decode_weights == "fp32" and engine.runner.quantized_weight_bytes == 0
    tokens, _ = run(engine, "q", prompt_of(3, 50), max_tokens=5)
    assert len(tokens) == 5
    engine.shutdown()
