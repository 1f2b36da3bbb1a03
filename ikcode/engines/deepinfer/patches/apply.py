"""Add a read-only `Sequence.block_table` binding to an unpacked deepinfer==0.1.0 source tree.

Python cannot read a sequence's block table: the field is `seq.cache.block_table`
(csrc/engine/sequence.hpp:206) and csrc/engine/pybind_sequence.cpp:109-137 binds every other
`Sequence` field but not that one. This inserts one line after the `branch_id` binding (:137),
with the file's own helper for read-only fields (:19-22):

    bind_sequence_readonly(sequence, "block_table",
        [](const Sequence &seq) -> const auto & { return seq.cache.block_table; });  (one line)

The already-patched check looks for that exact line, so nothing else in the file (for instance
`py::arg("block_table")` of SequenceMetadata, :150) can pass for it. The CPU build of the engine
core (tests/deepinfer_build/) applies this patch and compiles it, so a wrong patch fails there.

Usage (see README.md in this folder):
    python -m ikcode.engines.deepinfer.patches.apply path/to/deepinfer-0.1.0
"""

from __future__ import annotations

import sys
from pathlib import Path

BINDING_FILE = "csrc/engine/pybind_sequence.cpp"
BINDING = (
    'bind_sequence_readonly(sequence, "block_table", '
    "[](const Sequence &seq) -> const auto & { return seq.cache.block_table; });"
)
MARKER = BINDING + "  // ikcode: read-only block table"
ANCHOR = 'bind_sequence_property(sequence, "branch_id",'


class PatchError(Exception):
    pass


def patch_text(text: str) -> tuple[str, bool]:
    """(new text, changed). Raises PatchError when the anchor line is missing or not unique."""
    lines = text.splitlines(keepends=True)
    if any(line.strip() == MARKER for line in lines):
        return text, False
    hits = [i for i, line in enumerate(lines) if line.lstrip().startswith(ANCHOR)]
    if len(hits) != 1:
        raise PatchError(f"expected one line starting with {ANCHOR!r} in {BINDING_FILE}, found {len(hits)}")
    i = hits[0]
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    lines.insert(i + 1, indent + MARKER + "\n")
    return "".join(lines), True


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
