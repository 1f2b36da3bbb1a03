"""The embedded engine on a CUDA device: it serves, its host tier is page-locked with a staging
buffer paid for out of the host budget, and blocks demoted to the host come back byte for byte.
Skipped, saying so, where torch sees no CUDA device."""

from __future__ import annotations

import pytest
import torch

from ikcode.cache import hash_blocks
from ikcode.engines.embedded.host_kv import HostKV
from tests.test_tiers_engine import BLOCK_BYTES, BS, fill_device, prompt_of, run
from tests.tiny_model import assert_pool_clean, block_bytes, tiny_engine

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False here)"
)


def cuda_engine(**config):
    defaults = dict(device="cuda", kv_memory_bytes=32 * BLOCK_BYTES, host_kv_memory_bytes=128 * BLOCK_BYTES)
    defaults.update(config)
    return tiny_engine(**defaults)


@pytest.mark.parametrize("staging_blocks, host_blocks", [(16, 112), (12, 112)])
def test_staging_buffers_are_page_locked_and_paid_for_out_of_the_host_budget(staging_blocks, host_blocks):
    # 16 blocks of K (2 layers x 16 x 2 x 16 fp32) are 64 KiB, a power of two; 12 are 48 KiB, which
    # torch's page-locked allocator rounds up to 64 KiB: the tier loses 16 blocks either way.
    engine = cuda_engine(tier_staging_blocks=staging_blocks)
    runner = engine.runner
    assert engine.device.type == "cuda" and engine.device.index is not None and runner.k_pool.is_cuda
    assert runner.host_pinned and runner.host._stage_k.is_pinned() and runner.host._stage_v.is_pinned()
    assert not runner.host.k.is_pinned()  # the tier is only touched by the CPU
    assert runner.host.staging_blocks == staging_blocks
    assert engine.cache.num_host_blocks == host_blocks
    assert runner.host_kv_bytes == 128 * BLOCK_BYTES  # tier + staging, within host_kv_memory_bytes
    engine.shutdown()


def test_staged_copies_wait_for_the_device():
    # A busy stream (torch.cuda._sleep) before every copy: a copy that read the staging buffer
    # before its transfer landed, or refilled it while one still read it, moves the wrong bytes.
    device = torch.device("cuda", torch.cuda.current_device())
    layer_block = (2, 16, 2, 16)
    k_pool = torch.randn(2, 40, 16, 2, 16, device=device)
    v_pool = torch.randn(2, 40, 16, 2, 16, device=device)
    tier = HostKV(layer_block, 30, device, staging_blocks=3)
    pairs = [(b, 29 - b) for b in range(0, 20, 2)]  # 10 blocks: four chunks
    torch.cuda._sleep(10**8)
    tier.copy_device_to_host(k_pool, v_pool, pairs)
    for block, slot in pairs:
        assert torch.equal(tier.k[:, slot], k_pool[:, block].cpu())
        assert torch.equal(tier.v[:, slot], v_pool[:, block].cpu())
    back = [(slot, 39 - i) for i, (_, slot) in enumerate(pairs)]
    torch.cuda._sleep(10**8)
    tier.copy_host_to_device(k_pool, v_pool, back)
    torch.cuda.synchronize()
    for slot, block in back:
        assert torch.equal(k_pool[:, block].cpu(), tier.k[:, slot])
        assert torch.equal(v_pool[:, block].cpu(), tier.v[:, slot])


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
