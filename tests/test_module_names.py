"""No module of ours shadows a real package.

A benchmark script runs with ``benchmarks/`` as ``sys.path[0]``, and pytest (``prepend`` import mode,
no ``__init__.py`` in ``tests/``) puts each test file's folder on ``sys.path``; a test may add more
(``tests/runtime/models/test_hf_baseline.py`` adds ``benchmarks/``). A module found there named like an installed distribution's top-level module, a
standard-library module, or a package our dependencies import when present (``kernels``, which
transformers imports for its hub kernels) is imported in its place: transformers once failed to load
any model because ``benchmarks/kernels.py`` stood in for the PyPI package ``kernels``.
"""

from __future__ import annotations

import ast
import importlib.metadata
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# imported by our dependencies when installed, so absent from a lean environment's distributions:
# transformers (hub kernels, attention back ends, quantizers), accelerate, torch
OPTIONAL_IMPORTS = frozenset({
    "kernels", "flash_attn", "flash_attn_interface", "deepspeed", "peft", "bitsandbytes", "optimum",
    "torchao", "liger_kernel", "xformers", "apex", "vllm", "sglang", "hqq", "awq", "gptqmodel",
    "optimum_quanto", "compressed_tensors", "fbgemm_gpu", "mamba_ssm", "causal_conv1d", "timm",
    "torchvision", "torchaudio", "sentencepiece", "tiktoken", "protobuf", "google", "scipy", "sklearn",
    "pandas", "datasets", "evaluate", "wandb", "tensorboard", "mlflow", "psutil", "numba", "cupy",
})


def reserved_names() -> dict[str, str]:
    """Top-level module name -> what owns it (a distribution, the standard library, an optional import)."""
    names = {name: "an optional import of our dependencies" for name in OPTIONAL_IMPORTS}
    names |= {name: "the standard library" for name in sys.stdlib_module_names}
    for name, dists in importlib.metadata.packages_distributions().items():
        if not any(d.lower() == "shardsmith" for d in dists):
            names[name] = "the installed distribution " + ", ".join(sorted(set(dists)))
    return names


def path_folders() -> list[Path]:
    """Every folder of this checkout that a benchmark or test run puts on ``sys.path``."""
    folders = [ROOT / "benchmarks", ROOT / "benchmarks" / "gpu", ROOT / "tests"]
    folders += sorted(p.parent for p in (ROOT / "tests").rglob("test_*.py"))
    for script in sorted([*ROOT.joinpath("benchmarks").rglob("*.py"), *ROOT.joinpath("tests").rglob("*.py")]):
        folders += [folder for folder in inserted_folders(script) if folder.is_dir()]
    return sorted(set(folders))


def inserted_folders(script: Path) -> list[Path]:
    """The folders ``script`` adds with ``sys.path.insert``/``append`` of an expression of ``__file__``
    (evaluated with ``Path`` and ``str`` only)."""
    out = []
    for node in ast.walk(ast.parse(script.read_text(), str(script))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("insert", "append") and ast.unparse(node.func.value) == "sys.path"
                and "__file__" in ast.unparse(node.args[-1])):
            expr = compile(ast.Expression(node.args[-1]), str(script), "eval")
            value = eval(expr, {"__builtins__": {}, "Path": Path, "str": str, "__file__": str(script)})  # noqa: S307
            out.append(Path(value).resolve())
    return out


def top_level_modules(folder: Path) -> dict[str, Path]:
    """Importable names a folder on ``sys.path`` provides: ``*.py`` files and regular packages."""
    mods = {p.stem: p for p in folder.glob("*.py")}
    mods |= {p.parent.name: p.parent for p in folder.glob("*/__init__.py")}
    return mods


def test_path_folders_include_those_tests_and_benchmarks_add() -> None:
    """The scan sees every test file's folder (pytest's prepend mode) and what the scripts add:
    ``benchmarks/`` (a test inserts it)."""
    folders = path_folders()
    assert ROOT / "tests" / "serve" in folders and ROOT / "tests" / "runtime" / "engine" in folders
    assert ROOT / "benchmarks" in folders
    assert inserted_folders(ROOT / "tests" / "runtime" / "models" / "test_hf_baseline.py") == [ROOT / "benchmarks"]
    assert inserted_folders(ROOT / "tests" / "conftest.py") == []  # the serve helpers live in shardsmith.testing


def test_no_module_on_a_path_folder_shadows_a_package() -> None:
    reserved = reserved_names()
    clashes = sorted(
        f"{path.relative_to(ROOT)} shadows {name!r}, owned by {reserved[name]}: rename it"
        for folder in path_folders() for name, path in top_level_modules(folder).items()
        if name in reserved and name != "conftest")
    assert not clashes, "\n".join(clashes)


def test_the_check_catches_the_collision_it_exists_for(tmp_path: Path) -> None:
    """A ``kernels.py`` beside the benchmarks is named as shadowing the hub-kernels package."""
    (tmp_path / "kernels.py").write_text("")
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "__init__.py").write_text("")
    (tmp_path / "fused_kernels.py").write_text("")
    reserved = reserved_names()
    assert sorted(n for n in top_level_modules(tmp_path) if n in reserved) == ["json", "kernels"]
