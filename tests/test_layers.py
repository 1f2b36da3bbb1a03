"""Imports point down the layers (STYLE.md, "Layer order"): a module never imports one above it.

Lower layers are reused by everything above them; an import pointing up makes a cycle waiting to
happen and drags a whole stack (the CLI, a concrete engine) into a module that should not need it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import ikcode

PACKAGE = Path(ikcode.__file__).resolve().parent

# (prefix, layer): the longest matching prefix decides; see STYLE.md.
LAYERS = (
    ("ikcode.paths", 1), ("ikcode.auth", 1), ("ikcode.profiles", 1), ("ikcode.cache", 1),
    ("ikcode.server_log", 1),
    ("ikcode.model", 1),
    ("ikcode.engines", 2),  # base, errors, events, request, stream, placement: the protocol
    ("ikcode.engines.embedded", 3), ("ikcode.engines.deepinfer", 3),
    ("ikcode.admission", 4),
    ("ikcode.gateway", 5), ("ikcode.upstream", 5),
    ("ikcode.daemon", 6), ("ikcode.launcher", 6), ("ikcode.doctor", 6), ("ikcode.plan", 6),
    ("ikcode.bench", 6),
    ("ikcode.stack", 7),
    ("ikcode.cli", 8), ("ikcode.__main__", 8),
)  # fmt: skip


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > best[0]:
                best = (len(prefix), layer)
    return None if best is None else best[1]


def module_name(path: Path) -> str:
    parts = ("ikcode",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, module: str) -> list[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            found.append(stem)
            found += [f"{stem}.{alias.name}" for alias in node.names]  # `from ikcode import stack`
    return found


def upward_imports() -> list[str]:
    wrong: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        mine = layer_of(module)
        if mine is None:
            continue
        for target in imported_modules(path, module):
            theirs = layer_of(target)
            if theirs is not None and theirs > mine:
                wrong.append(f"{module} (layer {mine}) imports {target} (layer {theirs})")
    return sorted(set(wrong))


def test_every_module_has_a_layer():
    modules = [module_name(p) for p in PACKAGE.rglob("*.py")]
    unplaced = [m for m in modules if m != "ikcode" and layer_of(m) is None]
    assert unplaced == []


def test_no_import_points_up_a_layer():
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    # The check itself can fail: a model module importing the gateway is reported.
    fake = tmp_path / "ikcode"
    (fake / "model").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "model" / "bad.py").write_text("from ikcode.gateway import app\nfrom ..stack import build\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert upward_imports() == [
        "ikcode.model.bad (layer 1) imports ikcode.gateway (layer 5)",
        "ikcode.model.bad (layer 1) imports ikcode.gateway.app (layer 5)",
        "ikcode.model.bad (layer 1) imports ikcode.stack (layer 7)",
        "ikcode.model.bad (layer 1) imports ikcode.stack.build (layer 7)",
    ]
