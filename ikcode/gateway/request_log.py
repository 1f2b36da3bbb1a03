"""One JSON line per request: how a user sees a silent cache miss, and nothing private.

No prompt text, no token ids and no auth token are written unless `log_prompts` is set.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

logger = logging.getLogger("ikcode.gateway")


def now_iso() -> str:
    """A request-log timestamp: UTC, ISO 8601, milliseconds."""
    return datetime.now(UTC).isoformat(timespec="milliseconds")


# Past this size the log moves to `<name>.1` (replacing an older one) and a new file begins: a
# busy server's log must not fill the disk. Two files of this size are all it ever keeps.
MAX_LOG_BYTES = 64 * 1024 * 1024


class RequestLog:
    def __init__(self, path: Path | None, max_bytes: int = MAX_LOG_BYTES):
        self.path = path
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._file = _open_private(path)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
        try:
            with self._lock:
                if self._file is None:
                    return
                self._file.write(line + "\n")
                self._file.flush()
                if self._file.tell() > self.max_bytes:
                    self._rotate()
        except OSError:  # a full disk must not fail the request
            logger.warning("could not write the request log at %s", self.path)

    def _rotate(self) -> None:
        assert self.path is not None and self._file is not None
        self._file.close()
        self.path.replace(self.path.with_name(self.path.name + ".1"))
        self._file = _open_private(self.path)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _open_private(path: Path):
    """For appending, mode 0600 when created: user names, session ids (prompts, with log_prompts)
    are no other account's to read, wherever `request_log_path` puts the file."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a", encoding="utf-8")
