"""At what conversation size does the real Claude Code client compact, under a given environment?

A loopback recorder answers every call and reports `input_tokens = U` in its usage, as a server
would for a conversation of U tokens. Turn 1 (`claude -p`) ends with that usage; turn 2
(`claude -p --continue`) then either sends its question straight away or first sends the
compaction (summary) request. A bisection over U finds the smallest size that compacts.

    .venv/bin/python bench/compaction_probe.py --claude .tools/claude-code/node_modules/.bin/claude \\
        --window 8192 --window 32768 --window 131072

For each window it runs the environment `ikcode claude` sets today (launcher), and prints
whether the client warned on stderr. Nothing leaves 127.0.0.1; each probe is two client runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ikcode.gateway.compaction import is_summary_request  # noqa: E402
from ikcode.launcher.rolemap import claude_env  # noqa: E402
from tests.recorder import Recorder  # noqa: E402

MODEL = "smollm2-135m-instruct"


def _client_env(home: Path, base_url: str, window: int, max_output: int, extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE"))}
    env["HOME"] = str(home)
    env["CLAUDE_CONFIG_DIR"] = str(home / ".claude")
    mapping = claude_env(
        served_model=MODEL,
        base_url=base_url,
        token="probe",
        context_window=window,
        max_output_tokens=max_output,
    )
    env = mapping.apply(env)
    for key, value in extra.items():
        if value == "":
            env.pop(key, None)
        else:
            env[key] = value
    # The settings file wins over the shell: write it with the same changes.
    settings = {k: v for k, v in mapping.set.items() if k not in extra}
    settings.update({k: v for k, v in extra.items() if v != ""})
    (home / "claude-settings.json").write_text(
        json.dumps({"env": settings, "modelOverrides": mapping.model_overrides})
    )
    return env


def _run(claude: str, env: dict, project: Path, prompt: str, cont: bool) -> subprocess.CompletedProcess:
    settings = Path(env["HOME"]) / "claude-settings.json"
    argv = [
        claude,
        "--settings",
        str(settings),
        "-p",
        prompt,
        "--output-format",
        "json",
        "--tools",
        "Bash,Read",
    ]
    if cont:
        argv.append("--continue")
    return subprocess.run(argv, env=env, cwd=project, capture_output=True, text=True, timeout=120)


def probe(claude: str, window: int, max_output: int, extra: dict[str, str], size: int) -> dict:
    """Two turns; the first reports `size` input tokens. Did turn 2 compact?"""
    with tempfile.TemporaryDirectory(prefix="ikcode-probe-") as tmp:
        home, project = Path(tmp) / "home", Path(tmp) / "project"
        home.mkdir()
        project.mkdir()
        (home / ".claude.json").write_text(
            json.dumps(
                {"hasCompletedOnboarding": True, "projects": {str(project): {"hasTrustDialogAccepted": True}}}
            )
        )
        reported = {"value": size}
        with Recorder(input_tokens=lambda body: reported["value"]) as recorder:
            env = _client_env(home, recorder.url, window, max_output, extra)
            first = _run(claude, env, project, "hello", cont=False)
            before = len(recorder.requests)
            reported["value"] = 100
            second = _run(claude, env, project, "and again", cont=True)
            posts = [r for r in recorder.requests[before:] if r["method"] == "POST" and r["body"]]
    if any(is_summary_request(r["body"]) for r in posts):
        outcome = "compacts"
    elif second.returncode != 0 or '"blocking_limit"' in second.stdout:
        outcome = "blocks" if '"blocking_limit"' in second.stdout else f"fails (exit {second.returncode})"
    else:
        outcome = "ok"
    return {"outcome": outcome, "stderr": (first.stderr + second.stderr).strip()}


def reactive(claude: str, window: int, max_output: int, extra: dict[str, str]) -> dict:
    """Turn 2's question is answered "prompt is too long" (as the gateway says it) once: does the
    client compact and ask again, and does the turn end well?"""
    refused: list[dict] = []

    def too_long(body: dict) -> tuple[int, dict] | None:
        if refused or is_summary_request(body) or len(body.get("messages") or []) < 3:
            return None
        refused.append(body)
        message = f"prompt is too long: {window + 100} tokens > {window - 1} maximum"
        return 400, {"type": "error", "error": {"type": "invalid_request_error", "message": message}}

    with tempfile.TemporaryDirectory(prefix="ikcode-probe-") as tmp:
        home, project = Path(tmp) / "home", Path(tmp) / "project"
        home.mkdir()
        project.mkdir()
        trust = {"hasCompletedOnboarding": True, "projects": {str(project): {"hasTrustDialogAccepted": True}}}
        (home / ".claude.json").write_text(json.dumps(trust))
        with Recorder(error=too_long) as recorder:
            env = _client_env(home, recorder.url, window, max_output, extra)
            _run(claude, env, project, "hello", cont=False)
            before = len(recorder.requests)
            second = _run(claude, env, project, "and again", cont=True)
            posts = [r["body"] for r in recorder.requests[before:] if r["method"] == "POST" and r["body"]]
    kinds = ["summary" if is_summary_request(b) else "turn" for b in posts]
    return {
        "requests": kinds,
        "exit": second.returncode,
        "too_long_shown": "prompt is too long" in second.stdout.lower(),
    }


def threshold(
    claude: str, window: int, max_output: int, extra: dict[str, str], high: int
) -> tuple[int | None, dict]:
    """Smallest reported size (to ~1%) at which turn 2 is not an ordinary turn (it compacts, or
    the client refuses with blocking_limit), and what happens there; None when `high` is ordinary."""
    top = probe(claude, window, max_output, extra, high)
    if top["outcome"] == "ok":
        return None, top
    low, hi, at = 1, high, top
    while hi - low > max(16, low // 100):
        mid = (low + hi) // 2
        found = probe(claude, window, max_output, extra, mid)
        if found["outcome"] != "ok":
            hi, at = mid, found
        else:
            low = mid
    return hi, at


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--claude", required=True, help="path of the claude executable")
    parser.add_argument("--window", type=int, action="append", required=True)
    parser.add_argument("--max-output", type=int, default=1024)
    parser.add_argument("--reactive", action="store_true", help="answer turn 2 'prompt is too long' once")
    parser.add_argument("--set", action="append", default=[], help="NAME=VALUE on top of the launcher's env")
    args = parser.parse_args()
    args.claude = str(Path(args.claude).resolve())
    version = subprocess.run([args.claude, "--version"], capture_output=True, text=True).stdout.strip()
    extra = dict(item.split("=", 1) for item in args.set)
    for window in args.window:
        if args.reactive:
            found = reactive(args.claude, window, args.max_output, extra)
            print(
                f"client {version} window {window}: after one 'prompt is too long' the client sent "
                f"{' -> '.join(found['requests'])}; exit {found['exit']}; error shown to the user: "
                f"{found['too_long_shown']}",
                flush=True,
            )
            continue
        found, at = threshold(args.claude, window, args.max_output, extra, high=300_000)
        shown = (
            "nothing up to 300000 tokens"
            if found is None
            else f"{at['outcome']} from {found} tokens ({found / window:.0%} of the window)"
        )
        print(f"client {version} window {window}: {shown}; extra env {extra or '-'}", flush=True)
        for line in at["stderr"].splitlines():
            print(f"    stderr: {line[:200]}")


if __name__ == "__main__":
    main()
