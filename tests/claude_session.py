"""A scripted multi-turn session of the REAL Claude Code client through `ikcode claude`
(`-p`, then `-p --continue`), and what the request log says about its compactions."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.serving import ikcode

FORBIDDEN = ("prompt is too long", "blocking_limit", "rapid_refill")


def turn_text(turn: int, approx_chars: int, seed: int = 0) -> str:
    """Notes about an imaginary code base (varied, so no two turns tokenize alike), then the ask."""
    rng = random.Random(seed * 1000 + turn)
    lines = [f"Here are my notes for part {turn} of the code review."]
    verbs = ("reads", "writes", "parses", "checks", "sorts", "merges", "loads", "sends")
    things = ("the config file", "a list of users", "the cache index", "two JSON blobs", "the log")
    while sum(len(line) + 1 for line in lines) < approx_chars:
        n = rng.randrange(1000)
        lines.append(
            f"Function step_{turn}_{n} in module part{turn}/file_{n % 37}.py {rng.choice(verbs)} "
            f"{rng.choice(things)} and returns {n * 7 % 101} items."
        )
    lines.append("Reply with the single word: noted.")
    return "\n".join(lines)


def count_tokens(url: str, token: str, model: str, text: str) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": text}]}
    headers = {"Authorization": f"Bearer {token}", "anthropic-version": "2023-06-01"}
    response = httpx.post(f"{url}/v1/messages/count_tokens", json=body, headers=headers, timeout=60)
    response.raise_for_status()
    return int(response.json()["input_tokens"])


@dataclass
class Session:
    turns: list[dict] = field(default_factory=list)  # per turn: exit code, result JSON, stderr

    @property
    def problems(self) -> list[str]:
        return self.problems_besides(set())

    @property
    def length_stops(self) -> set[int]:
        """Turns the client gave up because the model kept writing past the server's answer cap
        (its own max_tokens recovery ran out): a trait of the model's words, not of the serving."""
        stops = set()
        for i, turn in enumerate(self.turns):
            try:
                result = json.loads(turn["stdout"])
            except ValueError:
                continue
            if isinstance(result, dict) and result.get("api_error") == "max_output_tokens":
                stops.add(i)
        return stops

    def problems_besides(self, tolerated: set[int]) -> list[str]:
        found = []
        for i, turn in enumerate(self.turns):
            if i in tolerated:
                continue
            text = (turn["stdout"] + turn["stderr"]).lower()
            if turn["exit"] != 0:
                found.append(
                    f"turn {i}: exit {turn['exit']}: {turn['stdout'][-800:]} {turn['stderr'][-800:]}"
                )
            for word in FORBIDDEN:
                if word in text:
                    found.append(f"turn {i}: {word!r} reached the user: {turn['stdout'][-800:]}")
        return found


def run_session(
    texts: list[str], launcher_args: list[str], env: dict, project: Path, timeout_s: float = 900
) -> Session:
    session = Session()
    for i, text in enumerate(texts):
        args = ["claude", *launcher_args, "--", "-p", text, "--output-format", "json"]
        if i:
            args.append("--continue")
        proc = ikcode(*args, env=env, cwd=project, timeout=timeout_s)
        session.turns.append({"exit": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr})
    return session


def client_env(claude_bin: str, home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE"))}
    env.update({"HOME": str(home), "IKCODE_CLAUDE_BIN": claude_bin})
    return env


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compactions_and_reuse(log: list[dict], block: int) -> tuple[int, list[dict]]:
    """How many compactions were answered, and every time a request took up a compacted
    conversation again: a request after a compaction whose prompt is shorter than the one
    compacted, and the next request, which extends all of it (what it shares with it, as the
    gateway rendered them, and what it read from the cache)."""
    answered = [r for r in log if r.get("status", 200) == 200 and r.get("prompt_tokens")]
    compactions, reuse, compacted_size = 0, [], None
    for index, record in enumerate(answered):
        previous = answered[index - 1] if index else {}
        if (
            compacted_size is not None
            and previous
            and not previous.get("compaction")
            and previous["prompt_tokens"] < compacted_size
            and record.get("prefix_shared_tokens", 0) >= previous["prompt_tokens"] - block
        ):
            reuse.append(
                {
                    "new_prefix": previous["prompt_tokens"],
                    "next_prompt": record["prompt_tokens"],
                    "next_shared": record.get("prefix_shared_tokens", 0),
                    "next_cached": record.get("cached_tokens_device", 0)
                    + record.get("cached_tokens_host", 0),
                }
            )
        if record.get("compaction"):
            if not previous.get("compaction"):  # a retried summary is the same compaction
                compactions += 1
                compacted_size = record["prompt_tokens"]
    return compactions, reuse
