"""Where ikcode keeps things: platformdirs' config and state dirs, overridable for tests.

`IKCODE_HOME` (if set) puts config and state under one folder: tests and CI use it so that
nothing touches the user's real directories.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP = "ikcode"


def _home() -> Path | None:
    value = os.environ.get("IKCODE_HOME")
    return Path(value) if value else None


def config_dir() -> Path:
    home = _home()
    path = home / "config" if home else Path(platformdirs.user_config_dir(APP))
    return path


def state_dir() -> Path:
    home = _home()
    path = home / "state" if home else Path(platformdirs.user_state_dir(APP))
    return path


def cache_dir() -> Path:
    """Derived data that is expensive to rebuild (dequantized weights); IKCODE_CACHE_DIR wins."""
    explicit = os.environ.get("IKCODE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    home = _home()
    path = home / "cache" if home else Path(platformdirs.user_cache_dir(APP))
    return path


def user_profiles_dir() -> Path:
    return config_dir() / "profiles"


def ensure(path: Path, mode: int = 0o700) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=mode)
    return path
