"""Record what the real Claude Code client sends in a short session: tests/data/claude-session.json.

Run: .venv/bin/python -m tests.data.capture_claude_session [path/to/claude]

The client runs with the launcher's own environment and settings file against the loopback
recorder (tests/recorder.py), which scripts the replies: the model loads the deferred WebFetch
tool through ToolSearch, reads a file, answers; then a second turn with --continue. Every request
body is kept, with the temporary folders and the device id replaced by fixed strings, so the file
is the same wherever it is recorded (apart from the OS line and the date in the prompt).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ikcode.launcher.rolemap import claude_env
from tests.recorder import Recorder, canned_stream, tool_use_stream

SERVED = "smollm2-135m-instruct"
OWN_VARS = ("ANTHROPIC_", "CLAUDE")  # the user's own client settings stay out
OUT = Path(__file__).with_name("claude-session.json")
PROJECT = "/home/user/project"
TURNS = (["-p", "Load the web fetch tool, then read hello.txt."], ["-p", "And again?", "--continue"])


def capture(claude: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        home, project = Path(tmp, "home"), Path(tmp, "project")
        home.mkdir()
        project.mkdir()
        (project / "hello.txt").write_text("hello from the file\n")
        trust = {"hasCompletedOnboarding": True, "projects": {str(project): {"hasTrustDialogAccepted": True}}}
        (home / ".claude.json").write_text(json.dumps(trust))
        replies = [
            lambda m: tool_use_stream(m, "ToolSearch", {"query": "select:WebFetch"}, "toolu_rec01"),
            lambda m: tool_use_stream(m, "Read", {"file_path": str(project / "hello.txt")}, "toolu_rec02"),
            canned_stream,
        ]
        with Recorder(replies) as recorder:
            mapping = claude_env(
                served_model=SERVED, base_url=recorder.url, token="recorded", context_window=8192,
                max_output_tokens=1024,
            )  # fmt: skip
            settings = Path(tmp, "settings.json")
            settings.write_text(json.dumps({"env": mapping.set, "modelOverrides": mapping.model_overrides}))
            env = mapping.apply(
                {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE"))}
            )
            env["HOME"] = str(home)
            version = subprocess.run([claude, "--version"], capture_output=True, text=True, env=env).stdout
            for args in TURNS:
                argv = [claude, "--settings", str(settings), *args, "--output-format", "json"]
                proc = subprocess.run(argv, env=env, cwd=project, capture_output=True, text=True, timeout=300)
                if proc.returncode != 0:
                    raise SystemExit(f"claude exited {proc.returncode}: {proc.stderr[-2000:]}")
        posts = [r for r in recorder.requests if r["method"] == "POST"]
        text = json.dumps(
            {
                "client": version.split()[0],
                "requests": [
                    {"anthropic_beta": r["headers"].get("anthropic-beta", ""), "body": r["body"]}
                    for r in posts
                ],
            },
            ensure_ascii=False,
        )
        text = text.replace(str(project), PROJECT).replace(tmp, "/tmp/session")
    data = json.loads(text)
    for request in data["requests"]:
        metadata = request["body"].get("metadata") or {}
        if isinstance(metadata.get("user_id"), str):
            user = json.loads(metadata["user_id"])
            user["device_id"] = "0" * 64
            metadata["user_id"] = json.dumps(user, separators=(",", ":"))
    return data


def main() -> None:
    claude = sys.argv[1] if len(sys.argv) > 1 else os.environ["IKCODE_TEST_CLAUDE_BIN"]
    data = capture(str(Path(claude).resolve()) if os.sep in claude else claude)
    OUT.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    print(f"{OUT}: {len(data['requests'])} requests from claude {data['client']}")


if __name__ == "__main__":
    main()
