"""Add a read-only `Sequence.block_table` binding to an unpacked deepinfer==0.1.0 source tree.

Python cannot read a sequence's block table (csrc/engine/pybind_sequence.cpp:109-137), and the
adapter copies cached pages into it. This inserts one line next to the existing
`num_cached_tokens` binding of the same class:

    .def_property_readonly("block_table", [](const Sequence &s) { return s.block_table; })

Idempotent; prints what it did. Usage (see README.md in this folder):
    python -m ikcode.engines.deepinfer.patches.apply path/to/deepinfer-0.1.0
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

BINDING_FILE = "csrc/engine/pybind_sequence.cpp"
MARKER = '"block_table"'
# e.g.  .def_readwrite("num_cached_tokens", &Sequence::num_cached_tokens)
_ANCHOR = re.compile(
    r'^(?P<indent>\s*)\.def_readwrite\(\s*"num_cached_tokens"\s*,\s*&(?P<cls>[\w:]+)::num_cached_tokens'
)


class PatchError(Exception):
    pass


def patch_text(text: str) -> tuple[str, bool]:
    """(new text, changed). Raises PatchError when the anchor line is not found."""
    if MARKER in text:
        return text, False
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        m = _ANCHOR.match(line)
        if m:
            cls = m.group("cls")
            new = (
                f'{m.group("indent")}.def_property_readonly("block_table", '
                f"[](const {cls} &s) {{ return s.block_table; }})  // ikcode: read-only block table\n"
            )
            lines.insert(i + 1, new)
            return "".join(lines), True
    raise PatchError(f'no .def_readwrite("num_cached_tokens", ...) line found in {BINDING_FILE}')


def apply(source_dir: Path) -> bool:
    path = source_dir / BINDING_FILE
    if not path.is_file():
        raise PatchError(f"{path} not found: pass the unpacked deepinfer-0.1.0 source folder")
    text, changed = patch_text(path.read_text(encoding="utf-8"))
    if changed:
        path.write_text(text, encoding="utf-8")
    return changed


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        changed = apply(Path(argv[0]))
    except PatchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print("patched " + BINDING_FILE if changed else "already patched: " + BINDING_FILE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
