"""Shared test setup: every test gets its own ikcode home (config, state, cache dirs)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _isolated_ikcode_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    home = tmp_path_factory.mktemp("ikcode-home")
    monkeypatch.setenv("IKCODE_HOME", str(home))
    # Dequantized weights are expensive to rebuild: one cache dir for the whole session.
    monkeypatch.setenv("IKCODE_CACHE_DIR", str(_session_cache_dir(tmp_path_factory)))
    yield home


_CACHE_DIR = None


def _session_cache_dir(factory: pytest.TempPathFactory):
    global _CACHE_DIR
    if _CACHE_DIR is None:
        explicit = os.environ.get("IKCODE_TEST_CACHE_DIR")
        _CACHE_DIR = explicit or str(factory.mktemp("ikcode-cache"))
    return _CACHE_DIR


CLAUDE_VERSION = os.environ.get("IKCODE_CLAUDE_VERSION", "2.1.332")


@pytest.fixture(scope="session")
def claude_bin() -> str:
    """The real Claude Code client from npm (installed into .tools/ if needed)."""
    import shutil
    import subprocess
    from pathlib import Path

    explicit = os.environ.get("IKCODE_TEST_CLAUDE_BIN")
    if explicit and os.access(explicit, os.X_OK):
        return explicit
    root = Path(__file__).resolve().parent.parent
    local = root / ".tools" / "claude-code" / "node_modules" / ".bin" / "claude"
    if local.exists():
        return str(local)
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: cannot get the real Claude Code client")
    subprocess.run(
        [
            "npm",
            "install",
            "--no-audit",
            "--no-fund",
            "--silent",
            "--prefix",
            str(local.parents[2]),
            f"@anthropic-ai/claude-code@{CLAUDE_VERSION}",
        ],
        check=True,
        timeout=600,
    )
    return str(local)


@pytest.fixture
def claude_home(tmp_path):
    """A HOME for the real client: onboarding done, the project trusted, nothing of the user's."""
    import json

    home = tmp_path / "home"
    project = tmp_path / "project"
    home.mkdir()
    project.mkdir()
    (home / ".claude.json").write_text(
        json.dumps(
            {
                "hasCompletedOnboarding": True,
                "projects": {str(project): {"hasTrustDialogAccepted": True}},
            }
        )
    )
    return home, project


@pytest.fixture(scope="session")
def default_model(tmp_path_factory: pytest.TempPathFactory):
    """The real default model, loaded once per session with its weight cache in the test folder
    (session fixtures run before the per-test isolation above, so set the cache dir here)."""
    from ikcode.model.loader import load_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("IKCODE_CACHE_DIR", str(_session_cache_dir(tmp_path_factory)))
        return load_model(None)


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project dir and a user config dir of our own: no settings file of the machine leaks in."""
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(tmp_path / "claude-config"))
    folder = tmp_path / "project"
    folder.mkdir()
    return folder
