"""One JSON line per request: how a user sees a silent cache miss, and nothing private.

No prompt text, no token ids and no auth token are written unless `log_prompts` is set.
"""

from __future__ import annotations

import json
import logging
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
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the app's life

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
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
