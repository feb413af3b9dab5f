"""The layer rule of the pack format, read from the imports: ``pack/`` imports neither ``writer/``
nor ``runtime/``; ``runtime/`` never imports ``writer/`` (issue 11)."""

from __future__ import annotations

import ast
from pathlib import Path

import shardsmith

PKG = Path(shardsmith.__file__).parent
RULES = {"pack": ("shardsmith.writer", "shardsmith.runtime"), "runtime": ("shardsmith.writer",)}


def imported(source: str, module: str) -> set[str]:
    """Absolute names of the modules ``source`` (the text of ``module``) imports, lazily or not."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = module.split(".")[: len(module.split(".")) - node.level] if node.level else []
            name = ".".join([*base, node.module or ""]).strip(".")
            out |= {name} | {f"{name}.{a.name}" for a in node.names}
    return out


def violations(layer: str) -> list[str]:
    out = []
    for path in sorted((PKG / layer).rglob("*.py")):
        module = "shardsmith." + path.relative_to(PKG).with_suffix("").as_posix().replace("/", ".")
        for name in sorted(imported(path.read_text(), module)):
            if name.startswith(RULES[layer]):
                out.append(f"{module} imports {name}")
    return out


def test_pack_and_runtime_keep_to_their_layer() -> None:
    assert violations("pack") == [] and violations("runtime") == []


def test_a_planted_violation_is_found() -> None:
    src = "from ..writer.slicing import cut\ndef f():\n    import shardsmith.runtime.engine\n"
    names = imported(src, "shardsmith.pack.banks")
    assert "shardsmith.writer.slicing.cut" in names and "shardsmith.runtime.engine" in names
    assert any(n.startswith(RULES["pack"]) for n in names)
