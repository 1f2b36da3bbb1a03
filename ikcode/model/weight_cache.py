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

# 2: the sidecar names the file's own model name (a hit takes the name asked for);
# 3: a harmony tokenizer's end-of-generation set (tokenizer.py)
FORMAT_VERSION = 3
_PROBE = 1 << 20  # bytes read at each end of the source for its identity
_WEIGHTS, _META = "state_dict.pt", "meta.json"


def _path_tag(source: Path) -> str:
    return hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:16]


def entry_dir(source: Path) -> Path:
    """The entry of the file as it is now: its path, inode, size and mtime, and a digest of its
    first and last MiB (a copy that kept the size and mtime, `cp -p` or `rsync -a`, is told apart
    by its bytes: a GGUF's header and tensor index lead, its last tensors close it)."""
    st = source.stat()
    digest = hashlib.sha256()
    with source.open("rb") as handle:
        digest.update(handle.read(_PROBE))
        handle.seek(max(0, st.st_size - _PROBE))
        digest.update(handle.read(_PROBE))
    identity = f"{source.resolve()}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{digest.hexdigest()}"
    identity += f"|v{FORMAT_VERSION}"
    return (
        paths.cache_dir()
        / "weights"
        / f"{_path_tag(source)}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"
    )


def load(entry: Path) -> tuple[dict[str, torch.Tensor], dict] | None:
    """The cached (state_dict, meta) of an entry, or None. An entry that cannot be read back
    (a truncated file, a sidecar of another version) is removed, so the next store replaces it."""
    if not entry.is_dir():
        return None
    try:
        meta = json.loads((entry / _META).read_text())
        if not isinstance(meta, dict) or not {"config", "tokenizer", "file_name"} <= meta.keys():
            raise ValueError("not this version's sidecar")
        state_dict = torch.load(entry / _WEIGHTS, mmap=True, weights_only=True, map_location="cpu")
    except Exception:  # whatever a damaged entry raises: rebuilt from the source
        shutil.rmtree(entry, ignore_errors=True)
        return None
    return state_dict, meta


def store(entry: Path, source: Path, state_dict: dict[str, torch.Tensor], meta: dict) -> Path | None:
    """Write `entry` (entry_dir(source) as read before converting: a file changed meanwhile is not
    stored under its new identity), replacing older entries of the same path; None if the disk
    refused."""
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
