"""The serving stack as a background service: pid file, port, log file in the state dir.

`ikcode up` spawns `ikcode up --foreground ...` in a new session with its output in the log file,
then waits until GET /health answers. One instance per state dir.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from ikcode import paths, server_log


class DaemonError(Exception):
    pass


@dataclass
class ServerState:
    pid: int
    host: str
    port: int
    url: str
    profile: str
    log_file: str
    started_at: float
    # What the process was when the file was written (see process_identity): a pid alone can
    # be reused by any program after a crash, and `ikcode down` must never signal a stranger.
    identity: str | None = None


def server_dir() -> Path:
    return paths.ensure(paths.state_dir() / "server")


def state_file() -> Path:
    return server_dir() / "server.json"


def log_file() -> Path:
    return server_dir() / "server.log"


def request_log_file() -> Path:
    return server_dir() / "requests.jsonl"


# After its drain deadline the server cuts what is left and answers it: this long to do so.
STOP_GRACE_S = 10.0


def drain_file() -> Path:
    return server_dir() / "drain_timeout_s"


def write_drain_timeout(timeout_s: float) -> None:
    """Tell the server how long to drain (read when SIGTERM arrives: `ikcode down --timeout`)."""
    drain_file().write_text(f"{timeout_s}\n")


def read_drain_timeout(default_s: float) -> float:
    try:
        value = float(drain_file().read_text().strip())
    except (OSError, ValueError):
        return default_s
    return value if value >= 0 else default_s


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours still answers kill(0): check its state.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def process_identity(pid: int) -> str | None:
    """Something that tells this process from a later one with the same pid: its start time
    (clock ticks since boot, /proc/<pid>/stat field 22), else `ps`'s start time. None: unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return "ticks:" + stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        pass
    try:
        out = subprocess.run(
            ["ps", "-o", "lstart=", "-p", str(pid)], capture_output=True, text=True, timeout=5, check=False
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"lstart:{out}" if out else None


def _command_line(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def is_our_server(state: ServerState) -> bool:
    """The pid in the state file is still the server that wrote it (not a reused pid)."""
    if not pid_alive(state.pid):
        return False
    if state.identity is not None:
        return process_identity(state.pid) == state.identity
    # A state file from before identities were recorded: at least the program must be ikcode.
    command = _command_line(state.pid)
    return command is None or "ikcode" in command


def read_state(clean_stale: bool = True) -> ServerState | None:
    """The running instance, or None. A pid file whose process is gone, or whose pid now belongs
    to another program, is removed."""
    path = state_file()
    if not path.is_file():
        return None
    try:
        state = ServerState(**json.loads(path.read_text()))
    except (ValueError, TypeError):
        state = None
    # A pid below 2 is no server (kill(-1) signals every process the user may signal).
    if state is None or not isinstance(state.pid, int) or state.pid < 2 or not is_our_server(state):
        if clean_stale:
            path.unlink(missing_ok=True)
        return None
    return state


def write_state(state: ServerState) -> None:
    path = state_file()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(state)))
    os.replace(tmp, path)


def clear_state(pid: int) -> None:
    current = state_file()
    try:
        if json.loads(current.read_text()).get("pid") == pid:
            current.unlink()
    except (OSError, ValueError):
        pass


def bind_problem(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port (None: it can), in words for the user."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except socket.gaierror:
            return f"cannot resolve the host {host!r}; give an address such as 127.0.0.1 or 0.0.0.0"
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return (
                    f"port {port} on {host} is already in use by another program; "
                    "choose another with --port or stop that program"
                )
            if err.errno == errno.EADDRNOTAVAIL:
                return (
                    f"address {host} is not assigned to this machine; use one of its own addresses, "
                    "127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"
                )
            if err.errno == errno.EACCES:
                return f"not allowed to listen on port {port} (ports below 1024 need privileges)"
            return f"cannot listen on {host}:{port}: {err.strerror or err}"
    return None


def port_in_use(host: str, port: int) -> bool:
    return bind_problem(host, port) is not None


@contextlib.contextmanager
def start_lock() -> Iterator[None]:
    """Held from "is a server running?" until the one started is healthy: two launchers started
    at once (two `ikcode claude` with no server up) would both find none and both start one."""
    with (server_dir() / "start.lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def check_can_start(host: str, port: int) -> None:
    running = read_state()
    if running is not None:
        raise DaemonError(
            f"ikcode is already running (pid {running.pid}) at {running.url} with profile "
            f"{running.profile!r}; stop it with `ikcode down` first"
        )
    problem = bind_problem(host, port)
    if problem is not None:
        raise DaemonError(problem)


def health(url: str, timeout_s: float = 2.0) -> dict | None:
    try:
        # trust_env=False: an HTTP_PROXY in the environment must not route a local check away.
        response = httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s, trust_env=False)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return response.json()
    except ValueError:
        return {}


def last_log_line(path: Path) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 4096))
            lines = handle.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""


# Set in the environment of a server `ikcode up` spawns: the launcher holds the start lock until
# that server answers, so the server must not wait for the lock itself.
SPAWNED_ENV = "IKCODE_SPAWNED_BY"


def start_background(
    child_args: list[str],
    host: str,
    port: int,
    url: str,
    profile: str,
    timeout_s: float = 600.0,
    on_progress: Callable[[str], None] | None = None,
) -> ServerState:
    """Spawn the foreground server detached, wait until healthy, return its state."""
    check_can_start(host, port)
    log = log_file()
    with log.open("ab") as handle:
        handle.write(f"\n==== starting {time.strftime('%Y-%m-%d %H:%M:%S')} ====\n".encode())
        handle.flush()
        start_offset = handle.tell()  # this start's lines begin here (earlier starts' are above)
        proc = subprocess.Popen(
            [sys.executable, "-m", "ikcode", *child_args],
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            # SPAWNED_ENV: this process holds the start lock while the child starts (stack.py).
            env={**os.environ, server_log.ENV_VAR: str(log), SPAWNED_ENV: str(os.getpid())},
        )
    state = ServerState(proc.pid, host, port, url, profile, str(log), time.time(), process_identity(proc.pid))
    write_state(state)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                clear_state(proc.pid)
                with log.open("rb") as handle:
                    handle.seek(start_offset)
                    ours = handle.read().decode(errors="replace")
                tail = "\n".join(ours.strip().splitlines()[-15:])
                raise DaemonError(f"the server exited with code {proc.returncode} while starting:\n{tail}")
            if health(url, timeout_s=1.0) is not None:
                return state
            if on_progress is not None:
                on_progress(last_log_line(log))
            time.sleep(0.25)
    except (KeyboardInterrupt, SystemExit):
        # Ctrl-C while it loads: the child runs in a session of its own and would go on serving.
        _abandon(proc)
        raise
    stop(timeout_s=10)
    raise DaemonError(f"the server did not become healthy within {timeout_s:.0f} s; see {log}")


def _abandon(proc: subprocess.Popen) -> None:
    """Stop a server whose start was given up, and forget it."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    clear_state(proc.pid)


def stop(timeout_s: float = 60.0) -> ServerState | None:
    """Graceful stop: SIGTERM lets in-flight requests finish; SIGKILL after the timeout."""
    state = read_state()  # only a state whose pid is still our server (identity checked)
    if state is None:
        return None
    write_drain_timeout(timeout_s)
    # The server may exit between any check and a signal (it was stopping already): that is done.
    with contextlib.suppress(ProcessLookupError):
        os.kill(state.pid, signal.SIGTERM)
        # The server drains for timeout_s, then answers what is left: a little grace before SIGKILL.
        deadline = time.monotonic() + timeout_s + STOP_GRACE_S
        while time.monotonic() < deadline and is_our_server(state):
            time.sleep(0.1)
        if is_our_server(state):  # checked again: never SIGKILL a pid that has been reused meanwhile
            _kill_hard(state.pid)
    clear_state(state.pid)
    return state


def _kill_hard(pid: int) -> None:
    """SIGKILL the server, and its process group when it leads one (`ikcode up` starts it in a
    session of its own, with the engine's worker processes in it: they would keep the GPUs)."""
    if os.getpgid(pid) == pid:
        os.killpg(pid, signal.SIGKILL)
    else:  # `ikcode up --foreground` in a terminal: its group is the shell's
        os.kill(pid, signal.SIGKILL)
