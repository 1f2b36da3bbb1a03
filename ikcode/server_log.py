"""The background server's log file, kept to a bounded size.

`ikcode up` starts the server with its stdout and stderr on `server.log` (daemon.start_background),
so a crash's traceback lands there too. The server logs a line for every failed request and every
connection that never sends a request head: a server left up for weeks, or one a hostile client
pokes, would grow the file without end. Past MAX_BYTES the file moves to `server.log.1`
(replacing an older one) and a new one begins; stdout and stderr are pointed at the new file, so
tracebacks and uvicorn's own lines follow it. Two files of MAX_BYTES are all it keeps.
"""

from __future__ import annotations

import logging
import os
import sys
from logging.handlers import RotatingFileHandler
from pathlib import Path

MAX_BYTES = 32 * 1024 * 1024
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Set by daemon.start_background for the server it spawns: the file its output goes to.
ENV_VAR = "IKCODE_SERVER_LOG"


class ServerLogHandler(RotatingFileHandler):
    """A RotatingFileHandler whose file is also the process's stdout and stderr."""

    def __init__(self, path: Path, max_bytes: int = MAX_BYTES):
        super().__init__(path, mode="a", maxBytes=max_bytes, backupCount=1, encoding="utf-8")
        self._adopt()

    def doRollover(self) -> None:  # noqa: N802 - logging's name
        super().doRollover()
        self._adopt()

    def _adopt(self) -> None:
        """Point fds 1 and 2 at the file the handler now writes (after a rollover: the new one)."""
        if self.stream is None:
            return
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.chmod(self.baseFilename, 0o600)
        for fd in (1, 2):
            os.dup2(self.stream.fileno(), fd)


def configure(level: int = logging.INFO, max_bytes: int = MAX_BYTES) -> None:
    """Log to the file `ikcode up` gave this server (size-bounded), else to stderr."""
    path = os.environ.get(ENV_VAR)
    if path:
        handler: logging.Handler = ServerLogHandler(Path(path), max_bytes)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)  # whatever logged before
