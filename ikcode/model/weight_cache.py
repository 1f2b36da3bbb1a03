"""A disk cache of converted weights, so the second start of a model skips dequantization.

An entry is a folder under `cache_dir()/weights/` named by the source file's identity (resolved
path, size, mtime) and a format version; it holds the fp32 state dict (`torch.save`, loaded back
memory-mapped, so a warm start costs page faults, not a 0.5 GB read) and a JSON sidecar
(config fields, the built tokenizer). Entries are written to a temporary folder and renamed into
place, so a crash or a concurrent start never leaves a half-written entry that looks whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ikcode import paths

FORMAT_VERSION = 1
_WEIGHTS, _META = "state_dict.pt", "meta.json"


def _path_tag(source: Path) -> str:
    return hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:16]


def entry_dir(source: Path) -> Path:
    st = source.stat()
    identity = f"{source.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{FORMAT_VERSION}"
    return (
        paths.cache_dir()
        / "weights"
        / f"{_path_tag(source)}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"
    )


def load(source: Path) -> tuple[dict[str, torch.Tensor], dict] | None:
    """The cached (state_dict, meta) for this source file, or None."""
    entry = entry_dir(source)
    try:
        meta = json.loads((entry / _META).read_text())
        state_dict = torch.load(entry / _WEIGHTS, mmap=True, weights_only=True, map_location="cpu")
    except (OSError, ValueError, RuntimeError):
        return None
    return state_dict, meta


def store(source: Path, state_dict: dict[str, torch.Tensor], meta: dict) -> Path | None:
    """Write an entry (replacing older entries of the same source path); None if the disk refused."""
    entry = entry_dir(source)
    tmp: Path | None = None
    try:
        root = paths.ensure(entry.parent)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
        torch.save(state_dict, tmp / _WEIGHTS)
        (tmp / _META).write_text(json.dumps(meta))
        for stale in root.glob(f"{_path_tag(source)}-*"):  # the file changed: drop its old entries
            if stale != entry:
                shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, entry)
            tmp = None
        except OSError:  # another process stored the same entry first
            pass
    except OSError:
        return None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return entry
