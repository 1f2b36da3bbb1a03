"""The host tier's K/V tensors and the block copies between them and the device pool.

On CUDA every copy goes through a page-locked staging buffer of `staging_blocks` blocks. The blocks
of one copy are scattered over the pool (or the host tier); gathering them makes a temporary
tensor, and a transfer from or to pageable memory is bounced by the driver through a buffer of its
own, synchronously (torch's `Tensor.to(non_blocking=True)` only overlaps for page-locked memory).
The tier itself stays in ordinary RAM: only the CPU's index copies touch it. torch's page-locked
allocator rounds an allocation up to a power of two below a size threshold (torch 2.13,
ATen/core/CachingHostAllocator.h, `allocate`: PowerOf2Ceil), so the buffers' budget share is that
rounded size (`staging_reserved_bytes`, an upper bound), taken out of the host budget
(kv_pools.py). Without CUDA there is nothing to stage: the copies are index operations on RAM.
"""

from __future__ import annotations

import torch


class HostKV:
    def __init__(
        self,
        layer_block_shape: tuple[int, ...],  # (num_layers, block_size, kv_heads, head_dim)
        num_blocks: int,
        device: torch.device,
        staging_blocks: int = 0,
    ):
        self.device = device
        layers, *block = layer_block_shape
        self.block_shape = tuple(block)  # one layer's block: (block_size, kv_heads, head_dim)
        shape = (layers, num_blocks, *block)
        self.k = torch.zeros(shape, dtype=torch.float32)
        self.v = torch.zeros(shape, dtype=torch.float32)
        # One flat buffer per K and V: a copy of m blocks views its first layers * m blocks as
        # [layers, m, ...], contiguous whatever m is (a slice of a [layers, staging, ...] tensor
        # along its second dimension would not be, and a strided page-locked view is copied
        # through a pageable temporary again).
        self.staging_blocks = staging_blocks
        pin = device.type == "cuda" and torch.cuda.is_available() and staging_blocks > 0
        elements = layers * staging_blocks * torch.Size(block).numel()
        self._stage_k = torch.empty(elements, dtype=torch.float32, pin_memory=pin)
        self._stage_v = torch.empty(elements, dtype=torch.float32, pin_memory=pin)

    @staticmethod
    def staging_reserved_bytes(layer_block_shape: tuple[int, ...], staging_blocks: int, pinned: bool) -> int:
        """Host memory the K and V staging buffers take: page-locked, each rounded up to a power
        of two by torch's allocator."""
        one = torch.Size(layer_block_shape).numel() * staging_blocks * 4  # fp32
        return 2 * (1 << (one - 1).bit_length() if pinned and one else one)

    @property
    def nbytes(self) -> int:
        """The tier and its staging buffers: what the host budget pays for."""
        staging = self.staging_reserved_bytes(
            (self.k.shape[0], *self.block_shape), self.staging_blocks, self.pinned
        )
        return self.k.nbytes + self.v.nbytes + staging

    @property
    def pinned(self) -> bool:
        """Whether the copies go through page-locked memory (the staging buffers)."""
        return self._stage_k.is_pinned()

    def copy_device_to_host(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, pairs: list[tuple[int, int]]
    ) -> None:
        """Pool blocks to host slots: pairs of (device_block, host_slot)."""
        for chunk in self._chunks(pairs):
            device_ids = torch.tensor([d for d, _ in chunk], device=self.device)
            host_ids = torch.tensor([h for _, h in chunk])
            staged = []
            for pool, stage in ((k_pool, self._stage_k), (v_pool, self._stage_v)):
                blocks = pool.index_select(1, device_ids)  # gathered on the device
                if self.staging_blocks:
                    blocks = self._view(stage, len(chunk)).copy_(blocks, non_blocking=True)
                staged.append(blocks)
            self._wait()  # both transfers have landed before the host reads the buffers
            for tier, blocks in zip((self.k, self.v), staged, strict=True):
                tier.index_copy_(1, host_ids, blocks.cpu())

    def copy_host_to_device(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, pairs: list[tuple[int, int]]
    ) -> None:
        """Host slots to pool blocks: pairs of (host_slot, device_block)."""
        for chunk in self._chunks(pairs):
            host_ids = torch.tensor([h for h, _ in chunk])
            device_ids = torch.tensor([d for _, d in chunk], device=self.device)
            for pool, tier, stage in ((k_pool, self.k, self._stage_k), (v_pool, self.v, self._stage_v)):
                if self.staging_blocks:
                    blocks = torch.index_select(tier, 1, host_ids, out=self._view(stage, len(chunk)))
                else:
                    blocks = tier.index_select(1, host_ids)
                pool.index_copy_(1, device_ids, blocks.to(self.device, non_blocking=True))
            self._wait()  # the buffer is not refilled while a transfer still reads it

    # ---- internals ---------------------------------------------------------------------------
    def _chunks(self, pairs: list[tuple[int, int]]):
        step = self.staging_blocks or len(pairs) or 1
        for start in range(0, len(pairs), step):
            yield pairs[start : start + step]

    def _view(self, stage: torch.Tensor, num_blocks: int) -> torch.Tensor:
        layers = self.k.shape[0]
        return stage[: layers * num_blocks * torch.Size(self.block_shape).numel()].view(
            layers, num_blocks, *self.block_shape
        )

    def _wait(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
