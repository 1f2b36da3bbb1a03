"""Copies between a rank's KV blocks and host memory, queued on the GPU without waiting for it.

DeepInfer overlaps the CPU's scheduling of step k+1 with the GPU's step k (zero-overhead
scheduling: a decode step's post-processing is deferred, worker.py:183-187), and a blocking
device-to-host copy waits for everything already queued, the running forward included. So every
copy here is non-blocking, and what depends on it waits on an event recorded after it: a block
copied from stays pinned until then (RankCache.release_copied, as DeepInfer's own DeferredRelease
does for its block clones, llm_engine.py:67-118), and a window snapshot is waited for only when a
later turn loads it (HostCopy.ready), by then long done. On a CPU copies are done when they return.
"""

from __future__ import annotations

from typing import Any


def queued_event(device_tensor: Any) -> Any:
    """An event after the work queued so far on the current stream; None on a CPU."""
    if not getattr(device_tensor, "is_cuda", False):
        return None
    import torch

    event = torch.cuda.Event()
    event.record()
    return event


class PageMover:
    """Copies 128-token KV pages. DeepInfer keeps every layer of a block in one row of
    `gpu_blocks[num_blocks, bytes]` (worker/cache_engine.py:937-960), so a page is a row; the host
    tier is a [pages, bytes] tensor in host RAM (a slice of the node's shared pool, page-locked
    when the cache is on a GPU)."""

    def __init__(self, gpu_blocks: Any, host_pages: Any = None):
        self.gpu_blocks = gpu_blocks
        self.host = host_pages

    def device_to_device(self, src: int, dst: int) -> None:
        self.gpu_blocks[dst].copy_(self.gpu_blocks[src], non_blocking=True)

    def device_to_host(self, block: int, page: int) -> None:
        self.host[page].copy_(self.gpu_blocks[block], non_blocking=True)

    def host_to_device(self, page: int, block: int) -> None:
        self.gpu_blocks[block].copy_(self.host[page], non_blocking=True)

    def mark(self) -> Any:
        """An event after the copies queued so far (None on a CPU)."""
        return queued_event(self.gpu_blocks)


class HostCopy:
    """A tensor being copied to page-locked host memory, and the event after its copy."""

    def __init__(self, tensor: Any, event: Any):
        self.tensor, self.event = tensor, event

    @property
    def nbytes(self) -> int:
        """The page-locked memory it may hold: torch's pinned-memory cache rounds a request up
        to the next power of two below a size threshold (ATen/core/CachingHostAllocator.h:300-306,
        torch 2.13): counted at that, an upper bound."""
        n = int(self.tensor.nbytes)
        return 1 << (n - 1).bit_length() if n > 1 else n

    def ready(self) -> Any:
        """The host tensor, once its copy has run."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.tensor


def state_to_host(snapshot: Any) -> Any:
    """A sliding-window snapshot kept outside the engine's memory budget: a HostCopy into
    page-locked memory when it was read from a GPU (select_state_slice_to_store allocates on the
    state cache's device, cache_engine.py:793-795); as it is otherwise."""
    if snapshot is None or not getattr(snapshot, "is_cuda", False):
        return snapshot
    import torch

    host = torch.empty(snapshot.shape, dtype=snapshot.dtype, pin_memory=True)
    host.copy_(snapshot, non_blocking=True)
    return HostCopy(host, queued_event(snapshot))


def host_tensor(snapshot: Any) -> Any:
    """What state_to_host kept, as a tensor in host memory."""
    return snapshot.ready() if isinstance(snapshot, HostCopy) else snapshot
