"""The host tier's shared-memory pool: created by the gateway, mapped by spawned rank processes,
and gone from /dev/shm even when the gateway dies without closing it (the resource tracker the
ranks share with it must keep the gateway's registration)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ikcode.engines.deepinfer.host_pool import HostPool, attach_pages

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this machine")

PAGE_BYTES = 4096


def _rank(name: str, ready) -> None:  # a spawned process, as a rank is
    pages = attach_pages(name, 0, 4, PAGE_BYTES)
    pages[0, 0] = 7
    ready.put("attached")


def _gateway_dies(ranks: int) -> None:
    """Create the pool, let `ranks` spawned processes map it and exit, then die by SIGKILL."""
    ctx = multiprocessing.get_context("spawn")
    pool = HostPool(8, PAGE_BYTES)
    print("created", pool.name, flush=True)
    ready = ctx.Queue()
    for _ in range(ranks):
        p = ctx.Process(target=_rank, args=(pool.name, ready))
        p.start()
        assert ready.get(timeout=60) == "attached"
        p.join(timeout=60)
    os.kill(os.getpid(), signal.SIGKILL)


def _segment_after_gateway_killed(ranks: int) -> Path:
    code = f"import tests.test_deepinfer_host_pool as t; t._gateway_dies({ranks})"
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    names = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("created")]
    assert names, out.stdout + out.stderr
    return Path("/dev/shm") / names[0]


@pytest.mark.parametrize("ranks", [0, 2])
def test_the_pool_is_removed_when_the_gateway_is_killed(ranks):
    segment = _segment_after_gateway_killed(ranks)
    deadline = time.monotonic() + 10  # the tracker unlinks once its last user is gone
    while segment.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    leaked = segment.exists()
    if leaked:
        segment.unlink()
    assert not leaked, f"{segment} outlived the gateway (ranks attached: {ranks})"


def test_a_clean_close_removes_the_pool_without_tracker_errors():
    ctx = multiprocessing.get_context("spawn")
    pool = HostPool(8, PAGE_BYTES)
    ready = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(pool.name, ready)) for _ in range(2)]
    for p in procs:
        p.start()
    for _ in procs:
        assert ready.get(timeout=60) == "attached"
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    pool.close()
    assert not (Path("/dev/shm") / pool.name).exists()


def test_a_pool_larger_than_shared_memory_is_refused_at_once():
    """Creating it only sets its size: a rank touching a page past /dev/shm's capacity died of
    SIGBUS mid-serving. Asking twice what the file system has free is refused, saying what to do."""
    import pytest

    from ikcode.engines.deepinfer.host_pool import SHM_DIR, HostPoolTooLarge

    free = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
    before = set(Path(SHM_DIR).iterdir())
    with pytest.raises(HostPoolTooLarge, match="host_cache_mb"):
        HostPool(2 * free // PAGE_BYTES + 1, PAGE_BYTES)
    assert set(Path(SHM_DIR).iterdir()) == before  # nothing created
