"""The package's layers, enforced by reading every module's imports (``ast``, nothing is imported).

==========================  ================================================================
modules                     must not import
==========================  ================================================================
``runtime/``                ``writer/``
``pack/``                   ``runtime/``, ``writer/``
``runtime/offload/``        ``runtime/models/`` (it imports ``runtime/layers/``, not a family)
``runtime/models/``         ``runtime/engine/``, ``runtime/offload/``, ``runtime/serve/``,
                            ``torch.distributed`` (models call the parallel layers)
``runtime/serve/encoding``  ``runtime/serve/chat`` (chat imports encoding: no cycle)
``families.py``             ``torch``, ``runtime/`` (read by ``plan``/``split`` without torch)
``runtime/layers/``         ``runtime/engine/``, ``runtime/models/``, ``runtime/offload/``,
                            ``runtime/serve/``
``runtime/layers/kernels/`` the layers above them (``experts``, ``parallel``); they take the
                            plain maths from ``quant``, ``pairs`` and ``staging``
``runtime/engine/``         ``runtime/serve/``
``runtime/models/<family>`` every other family (shared pieces: ``runtime/models/common``)
``checkpoint/``, ``plans/`` ``pack/``, ``writer/``, ``runtime/`` (the source side sits below)
``runtime/serve/streaming`` ``runtime/serve/server`` (it takes a typed ``Reply``, never calls back)
everything but V4's model   ``runtime/layers/kernels/deepseek_v4`` (V4's own kernels)
==========================  ================================================================

Imports inside functions count as well as module-level ones; relative imports are resolved. And no
import circle anywhere in ``shardsmith/`` (:func:`circles`).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import shardsmith

PACKAGE = Path(shardsmith.__file__).parent

FAMILIES = ("mixtral", "deepseek_v3", "deepseek_v4", "gpt_oss")

# (importer prefix, forbidden prefix, why)
RULES = (
    ("shardsmith.runtime", "shardsmith.writer", "the runtime reads packs through shardsmith.pack, never the writer"),
    ("shardsmith.pack", "shardsmith.runtime", "the pack format layer sits below the runtime"),
    ("shardsmith.pack", "shardsmith.writer", "the pack format layer sits below the writer"),
    ("shardsmith.runtime.offload", "shardsmith.runtime.models", "offload drives ExpertBanks from runtime.layers, never a model family"),
    ("shardsmith.runtime.models", "shardsmith.runtime.engine", "model files know nothing of the engine (CUDA graphs, loading)"),
    ("shardsmith.runtime.models", "shardsmith.runtime.offload", "model files know the offload cache only as an ExpertBank"),
    ("shardsmith.runtime.models", "shardsmith.runtime.serve", "model files know nothing of serving"),
    ("shardsmith.runtime.models", "torch.distributed", "model files know nothing of ranks: they call the parallel layers"),
    ("shardsmith.runtime.serve.encoding", "shardsmith.runtime.serve.chat", "chat imports encoding, never back (no cycle)"),
    ("shardsmith.families", "torch", "the registry is read by plan/split without torch"),
    ("shardsmith.families", "shardsmith.runtime", "the registry names runtime builders as dotted paths"),
    *(("shardsmith.runtime.layers", f"shardsmith.runtime.{up}", "layers sit below the engine, models, offload and serving")
      for up in ("engine", "models", "offload", "serve")),
    *(("shardsmith.runtime.layers.kernels", f"shardsmith.runtime.layers.{up}",
       "kernels sit below the layers that call them (plain maths: quant, pairs, staging)")
      for up in ("experts", "parallel")),
    ("shardsmith.runtime.engine", "shardsmith.runtime.serve", "the engine knows nothing of serving"),
    ("shardsmith.runtime.serve.streaming", "shardsmith.runtime.serve.server",
     "routes -> service -> streaming: streaming takes a typed Reply and never calls back"),
    *((f"shardsmith.runtime.models.{a}", f"shardsmith.runtime.models.{b}",
       "no family imports another: shared pieces live in runtime/models/common")
      for a in FAMILIES for b in FAMILIES if a != b),
    *((f"shardsmith.{low}", f"shardsmith.{up}", "the source side (checkpoint, plans) sits below packs and the runtime")
      for low in ("checkpoint", "plans") for up in ("pack", "writer", "runtime")),
    *((f"shardsmith.runtime.{other}", "shardsmith.runtime.layers.kernels.deepseek_v4",
       "DeepSeek-V4's own kernels are called by its model only")
      for other in ("models.mixtral", "models.deepseek_v3", "models.gpt_oss", "models.common", "layers.experts",
                    "layers.parallel", "engine", "offload", "serve")),
)



@dataclass(frozen=True, slots=True)
class Violation:
    module: str
    imported: str
    line: int
    why: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.imported}: {self.why}"


def module_name(path: Path, root: Path) -> str:
    """``root/pkg/a/b.py`` -> ``pkg.a.b`` (``__init__.py`` names its package)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, module: str) -> list[tuple[tuple[str, ...], int]]:
    """Every import statement of ``path``: the absolute names it may import (relative ones
    resolved; ``from pkg import x`` may import ``pkg`` or the module ``pkg.x``), with its line."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [((alias.name,), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out.append(((base, *(f"{base}.{alias.name}" for alias in node.names)), node.lineno))
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(root: Path, rules=RULES, known=frozenset()) -> list[Violation]:
    """Every import under ``root`` (a package directory) that breaks one of ``rules``, sorted."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        for names, line in imports(path, module):
            for importer, forbidden, why in rules:
                if not _under(module, importer):
                    continue
                hit = next((n for n in names if _under(n, forbidden)), None)  # the statement's first bad name
                if hit is not None and not any(module == m and _under(hit, f) for m, f in known):
                    found.add(Violation(module, hit, line, why))
    return sorted(found, key=lambda v: (v.module, v.line, v.imported))


def test_the_package_keeps_its_layers() -> None:
    bad = violations(PACKAGE)
    assert not bad, "layering broken:\n" + "\n".join(map(str, bad))


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "shardsmith"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_checker_finds_planted_violations(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "__init__.py": "",
        "runtime/__init__.py": "",
        "runtime/offload/__init__.py": "",
        "runtime/offload/runtime.py": "from ..models.mixtral import moe\n",  # relative, resolved
        "runtime/models/__init__.py": "",
        "runtime/models/mixtral.py": ("import torch\n\n\ndef f():\n"
                                      "    import torch.distributed as dist\n"  # inside a function
                                      "    from shardsmith.runtime.engine import cuda_graphs\n"),
        "runtime/layers/experts.py": "from shardsmith.writer import slicing\n",
        "pack/reader.py": "from shardsmith import runtime\nfrom shardsmith.runtime import layers\n",
        "families.py": "import importlib\n",
    })
    got = {(v.module, v.imported, v.line) for v in violations(root)}
    assert got == {
        ("shardsmith.runtime.offload.runtime", "shardsmith.runtime.models.mixtral", 1),
        ("shardsmith.runtime.models.mixtral", "torch.distributed", 5),
        ("shardsmith.runtime.models.mixtral", "shardsmith.runtime.engine", 6),
        ("shardsmith.runtime.layers.experts", "shardsmith.writer", 1),
        ("shardsmith.pack.reader", "shardsmith.runtime", 1),
        ("shardsmith.pack.reader", "shardsmith.runtime", 2),
    }, got


def test_a_clean_tree_and_a_known_exception_pass(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "runtime/layers/parallel.py": "import torch.distributed\nfrom shardsmith.writer.slicing import bank_specs\n",
        "runtime/models/m.py": "from shardsmith.runtime.layers import parallel\nimport torch\n",
        "writer/split.py": "from shardsmith.pack import format\n",
    })
    assert [str(v) for v in violations(root)] == [
        "shardsmith.runtime.layers.parallel:2 imports shardsmith.writer.slicing: "
        "the runtime reads packs through shardsmith.pack, never the writer"]
    assert violations(root, known={("shardsmith.runtime.layers.parallel", "shardsmith.writer.slicing")}) == []


def circles(root: Path) -> list[list[str]]:
    """Every import circle among the modules under ``root`` (strongly connected components of two or
    more modules, or a module importing itself), each sorted, the list sorted. A package's
    ``__init__`` counts as its module; ``from pkg import name`` counts as importing ``pkg.name``
    where that is a module, else ``pkg``."""
    modules = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for names, _ in imports(path, module):
            base, *members = names
            targets = [n for n in members if n in modules] or ([base] if base in modules else [])
            graph[module].update(t for t in targets if t != module or len(names) == 1)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_import_circle() -> None:
    found = circles(PACKAGE)
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_circle_check_finds_a_planted_circle(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "__init__.py": "",
        "a.py": "from shardsmith import b\n",
        "b.py": "def f():\n    from shardsmith.c import g\n",  # inside a function counts too
        "c.py": "from . import a\n",
        "d.py": "import shardsmith.a\n",  # into the circle, not part of it
    })
    assert circles(root) == [["shardsmith.a", "shardsmith.b", "shardsmith.c"]]
