"""Needle documents: filler text of a chosen size with one fact hidden in it, salted at the start.

The salt (unique per run) at the very start makes the first ask a true cold read on any engine:
nothing cached from an earlier run shares even the first block.
"""

from __future__ import annotations

import random
import secrets
from dataclasses import dataclass

_ADJ = ["quiet", "amber", "narrow", "distant", "early", "silver", "patient", "broken", "northern", "gentle"]
_NOUN = ["river", "ledger", "harbor", "lantern", "orchard", "engine", "archive", "bridge", "meadow", "tower"]
_VERB = [
    "follows",
    "records",
    "crosses",
    "guards",
    "mirrors",
    "outlasts",
    "divides",
    "carries",
    "lights",
    "joins",
]
_PLACE = ["old mill", "east gate", "market square", "lower valley", "station", "library", "quay", "ridge"]
_WORDS = [
    "falcon",
    "cobalt",
    "juniper",
    "quartz",
    "saffron",
    "tundra",
    "violet",
    "walnut",
    "zephyr",
    "marble",
]
QUESTION = "What is the secret passphrase written in the notes above? Reply with the passphrase only."


@dataclass(frozen=True)
class NeedleDocument:
    text: str
    passphrase: str
    salt: str


def new_salt() -> str:
    return secrets.token_hex(8)


def filler(rng: random.Random, chars: int) -> str:
    sentences: list[str] = []
    size = 0
    while size < chars:
        sentence = (
            f"The {rng.choice(_ADJ)} {rng.choice(_NOUN)} {rng.choice(_VERB)} the "
            f"{rng.choice(_NOUN)} near the {rng.choice(_PLACE)}."
        )
        sentences.append(sentence)
        size += len(sentence) + 1
    return " ".join(sentences)


def needle_document(chars: int, salt: str) -> NeedleDocument:
    rng = random.Random(salt)
    passphrase = f"{rng.choice(_WORDS)}-{rng.choice(_WORDS)}-{rng.randint(1000, 9999)}"
    head = f"Field notes, copy {salt}.\n\n"
    before = filler(rng, chars // 3)
    after = filler(rng, max(0, chars - chars // 3 - len(head)))
    fact = f"\n\nImportant: the secret passphrase is {passphrase}. Remember it.\n\n"
    return NeedleDocument(head + before + fact + after, passphrase, salt)


def request_body(model: str, document: NeedleDocument, max_tokens: int = 16) -> dict:
    return {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": f"{document.text}\n\n{QUESTION}"}],
    }
