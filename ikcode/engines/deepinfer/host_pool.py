"""The host tier: one shared-memory pool per node, created by the gateway process and mapped by
every rank process, each rank owning its own run of pages (no cross-process index to keep). On a
GPU machine each rank page-locks its pages (DeepInfer's Platform.pin_host_memory, platform.py:
cudaHostRegister) so H2D/D2H copies take the DMA path."""

from __future__ import annotations

import uuid
from multiprocessing import resource_tracker, shared_memory
from typing import Any


class HostPool:
    def __init__(self, num_pages: int, page_bytes: int):
        self.num_pages, self.page_bytes = num_pages, page_bytes
        self.shm = shared_memory.SharedMemory(
            name=f"ikcode-kv-{uuid.uuid4().hex[:12]}", create=True, size=max(1, num_pages * page_bytes)
        )

    @property
    def name(self) -> str:
        return self.shm.name

    def close(self) -> None:
        try:
            self.shm.close()
            self.shm.unlink()
        except FileNotFoundError:
            pass


_attached: list[Any] = []  # keep the mappings alive for the life of the rank process


def attach_pages(name: str, first_page: int, num_pages: int, page_bytes: int) -> Any:
    """Pages [first_page, first_page + num_pages) of the pool, as a [num_pages, page_bytes] uint8 tensor."""
    import torch

    shm = shared_memory.SharedMemory(name=name)
    # The gateway process owns the segment; the tracker must not unlink it when a rank exits.
    resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    _attached.append(shm)
    pages = torch.frombuffer(shm.buf, dtype=torch.uint8).view(-1, page_bytes)
    mine = pages[first_page : first_page + num_pages]
    try:
        import deepinfer

        if torch.cuda.is_available():
            deepinfer.PLATFORM.pin_host_memory(mine)
    except Exception:  # not pinned: copies still work, through pageable memory
        pass
    return mine
