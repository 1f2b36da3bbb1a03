"""Helpers for tests that run `ikcode` as a user would: subprocesses, a free port, a test profile."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from ikcode.profiles import shipped_profiles_dir


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ikcode(
    *args: str,
    env: dict | None = None,
    cwd: Path | None = None,
    timeout: float = 300,
    input: str | None = None,
):
    return subprocess.run(
        [sys.executable, "-m", "ikcode", *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or dict(os.environ),
        cwd=cwd,
    )


def local_profile(tmp_path: Path, port: int, max_output_tokens: int = 64) -> Path:
    """The shipped `local` profile on another port, greedy by default, with bounded answers."""
    text = (shipped_profiles_dir() / "local.toml").read_text()
    text = text.replace("port = 8741", f"port = {port}")
    text = text.replace("default_temperature = 0.2", "default_temperature = 0.0")
    assert "default_temperature = 0.0" in text
    text = text.replace("max_output_tokens = 1024", f"max_output_tokens = {max_output_tokens}")
    path = tmp_path / "test-local.toml"
    path.write_text(text)
    return path
