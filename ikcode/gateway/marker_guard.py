"""Guard characters around marker strings found in client text, so that the renderer tokenizes
them as the text they are (Renderer.guard and _encode_pieces say where they are put and read).
"""

from __future__ import annotations

import re
from typing import Any

# Around a marker string found in client text (Renderer.guard): Unicode noncharacters, which no
# text in interchange holds.
GUARD_OPEN, GUARD_CLOSE = "\ufdd0", "\ufdd1"
GUARDS = {GUARD_OPEN, GUARD_CLOSE}
GUARDED = re.compile(f"{GUARD_OPEN}[^{GUARD_CLOSE}]*{GUARD_CLOSE}")


def alternation(strings: Any) -> re.Pattern[str] | None:
    """A pattern matching any of strings, longest first (None: nothing to match)."""
    ordered = sorted(strings, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, ordered))) if ordered else None


def wrapped(pattern: re.Pattern[str], text: str) -> str:
    """text with each match of pattern between the guard characters; guard characters the client
    sent are replaced first, so that a span it opens cannot swallow the format's markup."""
    if GUARD_OPEN in text or GUARD_CLOSE in text:
        text = text.replace(GUARD_OPEN, "\ufffd").replace(GUARD_CLOSE, "\ufffd")
    return pattern.sub(lambda m: GUARD_OPEN + m.group(0) + GUARD_CLOSE, text)
