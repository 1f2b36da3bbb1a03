"""Does the default model loop? 20 coding questions to a real `ikcode up` on the `local` profile,
256 tokens each, at the profile's own sampling settings, with and without its repetition penalty.

Each question is sent as Claude Code sends a first turn through `ikcode claude` on this profile:
bench/data/claude_code_first_turn.json is such a request (client 2.1.332, the profile's
default arguments: its system prompt, the Bash and Read tools), captured with a loopback
recorder; only the question's text block is replaced.

    .venv/bin/python bench/repetition_loops.py            # ~5-10 min on two CPU cores

A reply "loops" when one sentence appears more than twice in it. Prints, per setting, how many of
the 20 replies loop and the worst repeat count. Each setting runs against its own server (a copy
of the shipped profile with only the penalty changed), one after the other; all on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import copy
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ikcode import auth, paths
from ikcode.profiles import load_profile, shipped_profiles_dir

HELLO_PY = 'def main():\n    print("Hello, world!")\n\n\nif __name__ == "__main__":\n    main()\n'
PROMPTS = [
    f"hello.py:\n```python\n{HELLO_PY}```\nWhat does hello.py print?",
    "What does `ls -la` show?",
    "Explain what a Python list comprehension is.",
    "How do I read a file line by line in Python?",
    "What is the difference between a tuple and a list?",
    "Write a function that reverses a string.",
    "What does `git status` do?",
    "Explain recursion with an example.",
    "What is a dictionary in Python?",
    "How do I install a package with pip?",
    "What does the `return` statement do?",
    "Explain what an HTTP status code 404 means.",
    "What is a for loop?",
    "How do I check if a number is even in Python?",
    "What does `cd ..` do in a terminal?",
    "What is an exception and how do I catch one?",
    "Explain what a variable is.",
    "What is JSON?",
    "How do I sort a list of numbers in Python?",
    "What does `import os` give me?",
]
CAPTURED = Path(__file__).resolve().parent / "data" / "claude_code_first_turn.json"
CAPTURED_QUESTION = "What does hello.py print?"
SENTENCE_SPLIT = re.compile(r"(?<=[.!?])\s+|\n+")


def worst_repeat(text: str) -> int:
    """How often the most repeated sentence (case and spacing ignored) occurs in text."""
    sentences = [" ".join(s.lower().split()) for s in SENTENCE_SPLIT.split(text)]
    counts = collections.Counter(s for s in sentences if len(s) >= 8)
    return max(counts.values(), default=0)


def _profile_copy(folder: Path, port: int, repeat_penalty: float, overrides: dict[str, str]) -> Path:
    text = (shipped_profiles_dir() / "local.toml").read_text()
    text = text.replace("port = 8741", f"port = {port}")
    for key, value in {"repeat_penalty": str(repeat_penalty), **overrides}.items():
        text, found = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
        assert found == 1, key
    path = folder / f"local-penalty-{repeat_penalty}.toml"
    path.write_text(text)
    return path


def claude_code_body(model: str, prompt: str, max_tokens: int) -> dict:
    """The captured first turn of Claude Code, asking `prompt` instead."""
    body = copy.deepcopy(json.loads(CAPTURED.read_text()))
    blocks = [b for m in body["messages"] if m["role"] == "user" for b in m["content"] if isinstance(b, dict)]
    question = next(b for b in blocks if b.get("text") == CAPTURED_QUESTION)
    question["text"] = prompt
    return {"model": model, "max_tokens": max_tokens, **body}


def _ask(url: str, token: str, model: str, prompt: str, max_tokens: int) -> str:
    body = claude_code_body(model, prompt, max_tokens)
    headers = {"Authorization": f"Bearer {token}", "anthropic-version": "2023-06-01"}
    response = httpx.post(f"{url}/v1/messages", json=body, headers=headers, timeout=900)
    response.raise_for_status()
    return "".join(block.get("text", "") for block in response.json()["content"])


def run_setting(profile_path: Path, max_tokens: int) -> list[str]:
    env = dict(os.environ)
    ikcode = [sys.executable, "-m", "ikcode"]
    up = subprocess.run(
        [*ikcode, "up", "--profile", str(profile_path)], capture_output=True, text=True, env=env
    )
    if up.returncode != 0:
        raise SystemExit(f"ikcode up failed: {up.stderr}")
    try:
        profile = load_profile(str(profile_path))
        token = auth.load_or_create_token()
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            futures = [
                pool.submit(_ask, profile.base_url, token, profile.served_model, p, max_tokens)
                for p in PROMPTS
            ]
            return [f.result() for f in futures]
    finally:
        subprocess.run([*ikcode, "down"], capture_output=True, text=True, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=21717)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--show", action="store_true", help="print every reply")
    parser.add_argument("--after-only", action="store_true", help="skip the run without the penalty")
    parser.add_argument(
        "--set", action="append", default=[], help="KEY=VALUE of [model] for the run with the penalty"
    )
    args = parser.parse_args()
    shipped = load_profile("local")
    print(
        f"profile local: temperature {shipped.model.default_temperature}, repeat_penalty "
        f"{shipped.model.repeat_penalty} and frequency_penalty {shipped.model.frequency_penalty} over "
        f"the last {shipped.model.repeat_last_n} tokens; "
        f"{len(PROMPTS)} prompts, max_tokens {args.max_tokens}; load average {os.getloadavg()[0]:.1f}"
    )
    with tempfile.TemporaryDirectory(prefix="ikcode-loops-") as tmp:
        # A home of its own (no clash with a server the user runs); the weight cache is shared.
        os.environ.setdefault("IKCODE_CACHE_DIR", str(paths.cache_dir()))
        os.environ["IKCODE_HOME"] = str(Path(tmp) / "home")
        overrides = dict(item.split("=", 1) for item in args.set)
        penalties = (
            (shipped.model.repeat_penalty,) if args.after_only else (1.0, shipped.model.repeat_penalty)
        )
        for penalty in penalties:
            started = time.perf_counter()
            # "before": every penalty off; "after": the profile's, with --set on top.
            off = {"frequency_penalty": "0.0", "presence_penalty": "0.0"}
            changed = overrides if penalty != 1.0 else off
            replies = run_setting(_profile_copy(Path(tmp), args.port, penalty, changed), args.max_tokens)
            worst = [worst_repeat(r) for r in replies]
            looping = sum(w > 2 for w in worst)
            label = (
                "penalties off (before)" if penalty == 1.0 else f"profile's penalties {changed or ''} (after)"
            )
            print(
                f"{label}: {looping}/{len(PROMPTS)} replies repeat a sentence more than twice; "
                f"worst repeat {max(worst)}x; hello.py reply worst {worst[0]}x "
                f"({time.perf_counter() - started:.0f} s)"
            )
            if args.show:
                for prompt, reply in zip(PROMPTS, replies, strict=True):
                    print(f"--- {prompt[-50:]!r}\n{reply}\n")


if __name__ == "__main__":
    main()
