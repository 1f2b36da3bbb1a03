"""The launcher's token file: created once, complete, 0600, and the same for two processes that
create it at once (a launcher and the server it starts)."""

from __future__ import annotations

import os
import stat
import threading
import time

from ikcode import auth


def test_two_creators_at_once_get_one_token(tmp_path, monkeypatch):
    """Writes are slowed so that the second creator looks while the first is writing: it found an
    empty file, took that for no token and wrote its own, and the first then held a token the
    file no longer had (its client got 401s)."""
    real_fdopen = os.fdopen

    class SlowFile:
        def __init__(self, handle):
            self.handle = handle

        def write(self, text):
            time.sleep(0.3)
            return self.handle.write(text)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

    monkeypatch.setattr(auth.os, "fdopen", lambda fd, *a, **k: SlowFile(real_fdopen(fd, *a, **k)))
    path = tmp_path / "token"
    got: list[str] = []
    first = threading.Thread(target=lambda: got.append(auth.load_or_create_token(path)))
    first.start()
    time.sleep(0.1)
    second = auth.load_or_create_token(path)
    first.join(10)
    assert got[0] == second == path.read_text().strip()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["token"]  # no temporary file left


def test_rotation_replaces_the_file_whole(tmp_path):
    path = tmp_path / "token"
    old = auth.load_or_create_token(path)
    new = auth.rotate_token(path)
    assert new != old and auth.load_or_create_token(path) == new
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
