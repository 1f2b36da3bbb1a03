"""Does the default model loop? 20 coding questions to a real `ikcode up` on the `local` profile,
256 tokens each, at the profile's own sampling settings, with and without its repetition penalty.

    .venv/bin/python bench/repetition_loops.py            # ~5-10 min on two CPU cores

A reply "loops" when one sentence appears more than twice in it. Prints, per setting, how many of
the 20 replies loop and the worst repeat count. Each setting runs against its own server (a copy
of the shipped profile with only the penalty changed), one after the other; all on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
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
SENTENCE_SPLIT = re.compile(r"(?<=[.!?])\s+|\n+")


def worst_repeat(text: str) -> int:
    """How often the most repeated sentence (case and spacing ignored) occurs in text."""
    sentences = [" ".join(s.lower().split()) for s in SENTENCE_SPLIT.split(text)]
    counts = collections.Counter(s for s in sentences if len(s) >= 8)
    return max(counts.values(), default=0)


def _profile_copy(folder: Path, port: int, repeat_penalty: float) -> Path:
    text = (shipped_profiles_dir() / "local.toml").read_text()
    text = text.replace("port = 8741", f"port = {port}")
    text = re.sub(r"(?m)^repeat_penalty = .*$", f"repeat_penalty = {repeat_penalty}", text)
    path = folder / f"local-penalty-{repeat_penalty}.toml"
    path.write_text(text)
    return path


def _ask(url: str, token: str, model: str, system: str, prompt: str, max_tokens: int) -> str:
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "system": system,
        "messages": [{"role": "user", "content": prompt}],
    }
    headers = {"Authorization": f"Bearer {token}", "anthropic-version": "2023-06-01"}
    response = httpx.post(f"{url}/v1/messages", json=body, headers=headers, timeout=900)
    response.raise_for_status()
    return "".join(block.get("text", "") for block in response.json()["content"])


def run_setting(profile_path: Path, max_tokens: int, system: str) -> list[str]:
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
                pool.submit(_ask, profile.base_url, token, profile.served_model, system, p, max_tokens)
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
    args = parser.parse_args()
    shipped = load_profile("local")
    # The system prompt `ikcode claude` gives Claude Code on this profile.
    default_args = shipped.claude.default_args
    system = default_args[default_args.index("--system-prompt") + 1]
    print(
        f"profile local: temperature {shipped.model.default_temperature}, repeat_penalty "
        f"{shipped.model.repeat_penalty} over the last {shipped.model.repeat_last_n} tokens; "
        f"{len(PROMPTS)} prompts, max_tokens {args.max_tokens}; load average {os.getloadavg()[0]:.1f}"
    )
    with tempfile.TemporaryDirectory(prefix="ikcode-loops-") as tmp:
        # A home of its own (no clash with a server the user runs); the weight cache is shared.
        os.environ.setdefault("IKCODE_CACHE_DIR", str(paths.cache_dir()))
        os.environ["IKCODE_HOME"] = str(Path(tmp) / "home")
        for penalty in (1.0, shipped.model.repeat_penalty):
            started = time.perf_counter()
            replies = run_setting(_profile_copy(Path(tmp), args.port, penalty), args.max_tokens, system)
            worst = [worst_repeat(r) for r in replies]
            looping = sum(w > 2 for w in worst)
            label = "without penalty (before)" if penalty == 1.0 else f"repeat_penalty {penalty} (after)  "
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
