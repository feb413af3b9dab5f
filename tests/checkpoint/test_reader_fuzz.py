"""Seeded mutation fuzzing of the checkpoint, header-inventory and index readers.

Each case makes one edit to one file of a valid checkpoint (a tiny Mixtral with real shards, a
SmolLM2-shaped FP8 inventory of ``.safetensors.json`` headers, a tiny DeepSeek-V4 turned into a
header-only inventory): a field of ``config.json``, of a tensor's header entry or of the index set to
a value of another type (NaN, inf, huge, negative, empty, wrong container), removed, or its whole
container replaced. Then ``inspect`` (tables and ``--json``) and ``plan --tp 2`` run in-process through
the CLI: each must succeed or raise a :class:`~shardsmith.errors.ShardsmithError` (exit 1/2 with a
message) or exit with a code, never another exception, within a time limit per case (no hang).

``SHARDSMITH_FUZZ_CASES`` sets the number of cases per checkpoint (default 100, three checkpoints:
300 in CI, under a minute); ``SHARDSMITH_FUZZ_SEED`` the seed (default 17).
"""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import struct
from pathlib import Path

import click
import pytest
from typer.testing import CliRunner

from shardsmith.cli import app
from shardsmith.errors import ShardsmithError

CASES = int(os.environ.get("SHARDSMITH_FUZZ_CASES", "100"))
SEED = int(os.environ.get("SHARDSMITH_FUZZ_SEED", "17"))
CASE_SECONDS = 20
VALUES: list[object] = [
    "x", "", "a" * 1000, "BF16", "F4", "../x", "/etc/passwd", {}, {"a": 1}, [], [[]], [1], [0, 2 ** 62], [-1, 4],
    [1, 2, 3], None, True, False, 0, -1, 1, 2, 3, 7, 0.5, 4.0, float("nan"), float("inf"), float("-inf"),
    2 ** 31, 2 ** 63, 10 ** 30, -(2 ** 40),
]
INDEX = "model.safetensors.index.json"
runner = CliRunner()


def _header_only(src: Path, dst: Path) -> Path:
    """Copy checkpoint ``src`` to ``dst`` with every shard replaced by its ``.safetensors.json`` header."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.name.endswith(".safetensors"):
            with open(p, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                (dst / (p.name + ".json")).write_bytes(fh.read(n))
        elif p.is_file():
            (dst / p.name).write_bytes(p.read_bytes())
    return dst


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from shardsmith.testing.headers import smollm2_moe_headers
    from shardsmith.testing.tiny import tiny_mixtral
    from shardsmith.testing.tiny_v4 import tiny_deepseek_v4

    root = tmp_path_factory.mktemp("fuzz-src")
    v4 = tiny_deepseek_v4(root / "v4-full", layers=2)
    return {
        "mixtral": tiny_mixtral(root / "mixtral", layers=2),
        "smollm2-fp8-headers": smollm2_moe_headers(root / "smol", fp8=True, layers=1, experts=2),
        "v4-headers": _header_only(v4, root / "v4"),
    }


def _paths(obj: object, prefix: tuple = ()) -> list[tuple]:
    """Every key path into nested dicts and lists of ``obj`` (the root excluded)."""
    out = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        out.append(prefix + (k,))
        if len(prefix) < 3:
            out += _paths(v, prefix + (k,))
    return out


def _mutate_json(doc: object, rng: random.Random) -> tuple[object, str]:
    """One edit of ``doc``: a value replaced, a key removed, or the whole document replaced."""
    paths = _paths(doc)
    if not paths or rng.random() < 0.05:
        new = rng.choice(VALUES)
        return new, f"whole document -> {new!r:.60}"
    doc = copy.deepcopy(doc)
    path = rng.choice(paths)
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if isinstance(parent, dict) and rng.random() < 0.2:
        del parent[path[-1]]
        return doc, f"removed {path!r:.80}"
    new = rng.choice(VALUES)
    parent[path[-1]] = new
    return doc, f"{path!r:.80} -> {new!r:.60}"


def _case(src: Path, dst: Path, rng: random.Random) -> str:
    """Make ``dst`` a copy of ``src`` (hard links) with one file edited; return what was edited."""
    dst.mkdir()
    files = sorted(p for p in src.iterdir() if p.is_file())
    targets = [p for p in files if p.name in ("config.json", INDEX) or p.name.endswith((".safetensors", ".json"))]
    target = rng.choice(targets)
    for p in files:
        if p != target:
            os.link(p, dst / p.name)
    if target.name.endswith(".safetensors"):  # a real shard: edit its header JSON, keep the data
        raw = target.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        doc, what = _mutate_json(json.loads(raw[8:8 + n]), rng)
        head = json.dumps(doc).encode()
        if rng.random() < 0.1:  # or lie about the header length
            what += " and a wrong header length"
            n_field = rng.choice([0, 1, len(head) + 1, len(raw), 2 ** 63])
        else:
            n_field = len(head)
        (dst / target.name).write_bytes(struct.pack("<Q", n_field) + head + raw[8 + n:])
    else:
        doc, what = _mutate_json(json.loads(target.read_text()), rng)
        (dst / target.name).write_text(json.dumps(doc))
    return f"{target.name}: {what}"


class _Timeout(Exception):
    pass


def _alarm(signum, frame):  # noqa: ANN001 - signal handler signature
    raise _Timeout


def _run(root: Path) -> None:
    """``inspect``, ``inspect --json`` and ``plan --tp 2`` in-process: a ShardsmithError or an exit code
    is a clean answer; any other exception is raised."""
    for args in (["inspect", str(root)], ["inspect", str(root), "--json"], ["plan", str(root), "--tp", "2"]):
        result = runner.invoke(app, args, standalone_mode=False)
        err = result.exception
        if err is not None and not isinstance(err, (ShardsmithError, SystemExit, click.exceptions.Exit)):
            raise err


@pytest.mark.parametrize("name", ["mixtral", "smollm2-fp8-headers", "v4-headers"])
def test_one_field_edits_never_crash_or_hang(sources: dict[str, Path], tmp_path: Path, name: str) -> None:
    src = sources[name]
    _run(src)  # the unedited source plans
    rng = random.Random(f"{SEED}-{name}")
    failures: list[str] = []
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for i in range(CASES):
            case = tmp_path / f"case-{i}"
            what = _case(src, case, rng)
            signal.alarm(CASE_SECONDS)
            try:
                _run(case)
            except _Timeout:
                failures.append(f"{what}: no answer within {CASE_SECONDS} s")
            except Exception as e:  # noqa: BLE001 - every other exception is the bug this test finds
                failures.append(f"{what}: {type(e).__name__}: {e!s:.200}")
            finally:
                signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, old)
    assert not failures, f"{len(failures)} of {CASES} cases (seed {SEED}) crashed:\n" + "\n".join(failures[:30])
