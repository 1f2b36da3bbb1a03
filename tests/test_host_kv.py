"""The host tier's block copies (engines/embedded/host_kv.py): through the staging buffer, in chunks
of its size, they move the same bytes as the direct copies; the buffer is counted in the tier's
bytes. On CUDA (tests/test_engine_cuda.py) the same code runs with page-locked memory."""

from __future__ import annotations

import pytest
import torch

from ikcode.engines.embedded.host_kv import HostKV

LAYER_BLOCK = (3, 4, 2, 8)  # layers, block_size, kv_heads, head_dim
BLOCK_ELEMENTS = 4 * 2 * 8


def pools(num_blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYER_BLOCK[0], num_blocks, *LAYER_BLOCK[1:])
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@pytest.mark.parametrize("staging_blocks", [1, 3, 7, 64])
def test_staged_copies_move_the_same_bytes_as_direct_ones(staging_blocks: int):
    k_pool, v_pool = pools(12, seed=1)
    direct = HostKV(LAYER_BLOCK, 10, torch.device("cpu"))
    staged = HostKV(LAYER_BLOCK, 10, torch.device("cpu"), staging_blocks=staging_blocks)
    demotions = [(11, 0), (2, 9), (5, 3), (0, 4), (7, 7), (3, 1), (9, 2)]  # 7 blocks, out of order
    for tier in (direct, staged):
        tier.copy_device_to_host(k_pool, v_pool, demotions)
    assert torch.equal(staged.k, direct.k) and torch.equal(staged.v, direct.v)
    for block, slot in demotions:
        assert torch.equal(staged.k[:, slot], k_pool[:, block])
        assert torch.equal(staged.v[:, slot], v_pool[:, block])

    promotions = [(9, 1), (0, 6), (4, 8), (7, 10), (2, 0)]
    back = {}
    for name, tier in (("direct", direct), ("staged", staged)):
        k_into, v_into = pools(12, seed=2)
        tier.copy_host_to_device(k_into, v_into, promotions)
        back[name] = (k_into, v_into)
    assert all(torch.equal(a, b) for a, b in zip(back["direct"], back["staged"], strict=True))
    k_into, v_into = back["staged"]
    for slot, block in promotions:
        assert torch.equal(k_into[:, block], staged.k[:, slot])
        assert torch.equal(v_into[:, block], staged.v[:, slot])


def test_the_staging_buffer_is_counted_in_the_tier_bytes():
    plain = HostKV(LAYER_BLOCK, 10, torch.device("cpu"))
    staged = HostKV(LAYER_BLOCK, 10, torch.device("cpu"), staging_blocks=4)
    block_bytes = 2 * LAYER_BLOCK[0] * BLOCK_ELEMENTS * 4  # K and V, every layer, fp32
    assert plain.nbytes == 10 * block_bytes
    assert staged.nbytes == 14 * block_bytes
    assert not staged.pinned  # page-locked memory is for CUDA transfers only
