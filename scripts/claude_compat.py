"""Does the Claude Code that npm serves today work with ikcode? Run: scripts/claude_compat.sh

Checks, with the client given (--claude) and the shipped default profile with its own claude
arguments (moved to a free port, at temperature 0 with answers of at most MAX_OUTPUT_TOKENS, as the
real-client test runs it, so a run takes minutes; everything under a temporary IKCODE_HOME and HOME):
  1. two turns through `ikcode claude` with the profile's own default arguments: exit 0, nothing
     on stderr but ikcode's own notice, turn 2 read >= 90% of its prompt from the cache (request log);
  2. a tool round trip: the client, answered by the loopback recorder with a Read call, runs the
     tool and sends the result back; those requests, as the client sent them, are then answered
     by the real server (HTTP 200, a complete stream);
  3. `ikcode statusline` prints the session's line.
Prints one line per check and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.recorder import Recorder, canned_stream, tool_use_stream  # noqa: E402

MIN_TURN2_HIT = 0.90
# At the profile's 1024 a 135M model can ramble to the limit, and the client then resumes the answer
# request after request until the window is full, minutes each on a CPU.
MAX_OUTPUT_TOKENS = 256
failures: list[str] = []


def check(ok: bool, what: str, detail: str = "", always: bool = False) -> None:
    """One result line; the detail is shown on failure (or always, for measured numbers)."""
    shown = detail.strip().replace("\n", " ")[:300] if detail and (always or not ok) else ""
    print(f"{'ok  ' if ok else 'FAIL'} {what}" + (f": {shown}" if shown else ""), flush=True)
    if not ok:
        failures.append(what)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ikcode(*args: str, env: dict, cwd: Path | None = None, input: str | None = None, timeout: float = 900):
    argv = [sys.executable, "-m", "ikcode", *args]
    return subprocess.run(
        argv, env=env, cwd=cwd, input=input, capture_output=True, text=True, timeout=timeout
    )


def foreign_stderr(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("ikcode: ")]


def log_lines(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def two_turns(env: dict, profile: Path, project: Path, log: Path) -> str | None:
    turns = (["-p", "Name one planet."], ["-p", "And another one?", "--continue"])
    seen, session = 0, None
    for number, args in enumerate(turns, 1):
        proc = ikcode(
            "claude", "--profile", str(profile), "--", *args, "--output-format", "json", env=env, cwd=project
        )
        check(proc.returncode == 0, f"turn {number}: exit 0", f"exit {proc.returncode} {proc.stderr[-300:]}")
        check(
            foreign_stderr(proc.stderr) == [],
            f"turn {number}: no stderr but ikcode's notice",
            proc.stderr[-500:],
        )
        try:
            result = json.loads(proc.stdout)
            session = result.get("session_id")
            check(
                result.get("is_error") is False,
                f"turn {number}: answered",
                str(result.get("result"))[:80],
                True,
            )
        except ValueError:
            check(False, f"turn {number}: JSON result", proc.stdout[-300:])
        lines = log_lines(log)
        if number == 2 and len(lines) > seen:
            first = lines[seen]
            cached = first.get("cached_tokens_device", 0) + first.get("cached_tokens_host", 0)
            rate = cached / max(1, first.get("prompt_tokens", 0))
            detail = (
                f"{cached}/{first.get('prompt_tokens')} tokens ({rate:.1%}), TTFT {first.get('ttft_ms')} ms"
            )
            check(rate >= MIN_TURN2_HIT, "turn 2 from cache >= 90%", detail, always=True)
            turn1 = lines[seen - 1] if seen else {}
            print(f"     turn 1 TTFT {turn1.get('ttft_ms')} ms; turn 2 TTFT {first.get('ttft_ms')} ms")
        seen = len(lines)
    return session


def tool_round_trip(env: dict, claude: str, profile: Path, project: Path, base_url: str, token: str) -> None:
    """The client runs a Read call and returns the result; the real server answers those requests."""
    (project / "hello.txt").write_text("hello from the file\n")
    replies = [lambda m: tool_use_stream(m, "Read", {"file_path": str(project / "hello.txt")}), canned_stream]
    with Recorder(replies) as recorder:
        proc = ikcode(
            "claude", "--profile", str(profile), "--base-url", recorder.url, "--",
            "-p", "Read hello.txt.", "--output-format", "json", env=env, cwd=project,
        )  # fmt: skip
    check(proc.returncode == 0, "tool round trip: client exit 0", proc.stderr[-300:])
    check(
        foreign_stderr(proc.stderr) == [],
        "tool round trip: no stderr but ikcode's notice",
        proc.stderr[-500:],
    )
    posts = [r for r in recorder.requests if r["method"] == "POST"]
    results = [
        block
        for r in posts
        for message in r["body"]["messages"]
        if isinstance(message["content"], list)
        for block in message["content"]
        if block.get("type") == "tool_result"
    ]
    check(
        any("hello from the file" in json.dumps(b) for b in results),
        "tool round trip: the client sent the result",
    )
    for index, request in enumerate(posts):
        headers = {
            k: v for k, v in request["headers"].items() if k.startswith(("anthropic-", "x-claude-code"))
        }
        headers["authorization"] = f"Bearer {token}"
        body = dict(request["body"], max_tokens=32)
        with httpx.stream(
            "POST", f"{base_url}/v1/messages?beta=true", json=body, headers=headers, timeout=600
        ) as r:
            text = r.read().decode()
        ok = r.status_code == 200 and "event: message_stop" in text
        check(
            ok,
            f"tool round trip: server answers request {index + 1} of {len(posts)}",
            f"HTTP {r.status_code}",
            always=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--claude", required=True, help="the claude executable to check")
    args = parser.parse_args()
    claude = str(Path(args.claude).resolve())
    version = subprocess.run([claude, "--version"], capture_output=True, text=True).stdout.strip()
    print(f"client: {version}")
    with tempfile.TemporaryDirectory(prefix="ikcode-compat-") as tmp:
        home, project = Path(tmp, "home"), Path(tmp, "project")
        home.mkdir()
        project.mkdir()
        trust = {"hasCompletedOnboarding": True, "projects": {str(project): {"hasTrustDialogAccepted": True}}}
        (home / ".claude.json").write_text(json.dumps(trust))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE"))}
        env.update(HOME=str(home), IKCODE_HOME=str(Path(tmp, "ikcode")), IKCODE_CLAUDE_BIN=claude)
        port = free_port()
        shipped = (ROOT / "ikcode" / "profiles" / "local.toml").read_text()
        profile = Path(tmp, "local.toml")
        bounded = re.sub(r"(?m)^port = \d+", f"port = {port}", shipped, count=1)
        bounded = re.sub(r"(?m)^max_output_tokens = \d+", f"max_output_tokens = {MAX_OUTPUT_TOKENS}", bounded)
        bounded = re.sub(r"(?m)^default_temperature = [\d.]+", "default_temperature = 0.0", bounded)
        profile.write_text(bounded)
        log = Path(tmp, "ikcode", "state", "server", "requests.jsonl")
        started = ikcode("up", "--profile", str(profile), env=env)
        check(started.returncode == 0, "ikcode up (default profile)", started.stderr[-500:])
        if started.returncode != 0:
            return 1
        try:
            session = two_turns(env, profile, project, log)
            token = ikcode("token", "--show", env=env).stdout.strip().splitlines()[-1]
            tool_round_trip(env, claude, profile, project, f"http://127.0.0.1:{port}", token)
            status = ikcode("statusline", env=env, input=json.dumps({"session_id": session}))
            check(
                status.returncode == 0 and "cache" in status.stdout,
                "ikcode statusline",
                status.stdout + status.stderr,
                always=True,
            )
        finally:
            ikcode("down", env=env)
    print("compatible" if not failures else f"NOT compatible: {len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
