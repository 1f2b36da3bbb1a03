"""The host tier: one shared-memory pool per node, created by the gateway process and mapped by
every rank process, each rank owning its own run of pages (no cross-process index to keep). On a
GPU machine each rank page-locks its pages (DeepInfer's Platform.pin_host_memory, platform.py:
cudaHostRegister) so H2D/D2H copies take the DMA path."""

from __future__ import annotations

import os
import uuid
from multiprocessing import resource_tracker, shared_memory
from typing import Any

SHM_DIR = "/dev/shm"  # where POSIX shared memory lives on Linux (a tmpfs)


class HostPoolTooLarge(ValueError):
    """The pool asked for does not fit the shared-memory file system."""


def check_room(size: int, shm_dir: str = SHM_DIR) -> None:
    """Refuse a pool larger than the shared-memory file system can hold: creating it only sets
    its size, and a rank touching a page past the tmpfs's capacity dies of SIGBUS mid-serving,
    failing the whole engine (Docker's default /dev/shm is 64 MB)."""
    try:
        stat = os.statvfs(shm_dir)
    except OSError:
        return  # no such file system to ask: let the creation say
    free = stat.f_bavail * stat.f_frsize
    if size > free:
        raise HostPoolTooLarge(
            f"the host tier asks for {size / 2**30:.1f} GiB of shared memory and {shm_dir} has "
            f"{free / 2**30:.1f} GiB free: lower [deepinfer] host_cache_mb, or give the machine "
            f"(or container: --shm-size) more shared memory"
        )


class HostPool:
    def __init__(self, num_pages: int, page_bytes: int):
        self.num_pages, self.page_bytes = num_pages, page_bytes
        check_room(num_pages * page_bytes)
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

    shm = _map_without_owning(name)
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


def _map_without_owning(name: str) -> Any:
    """Map the gateway's segment without taking it over: the gateway unlinks it at close, and
    its resource tracker unlinks it if the gateway dies first. A rank spawned by the gateway
    shares that tracker (multiprocessing hands the tracker's pipe to spawned children), whose
    registry is a set: the rank's own registration is a duplicate, and an unregister from the rank
    would remove the gateway's (the segment then outlived a killed gateway). Only a rank with a
    tracker of its own must unregister, or its tracker unlinks the segment when the rank exits."""
    try:
        return shared_memory.SharedMemory(name=name, track=False)  # Python >= 3.13: no registration
    except TypeError:
        pass
    shares_gateway_tracker = resource_tracker._resource_tracker._fd is not None  # noqa: SLF001
    shm = shared_memory.SharedMemory(name=name)
    if not shares_gateway_tracker:
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    return shm
