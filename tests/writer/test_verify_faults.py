"""Fault injection: every kind of damage makes ``shardsmith verify`` exit 2 naming the problem.

A pristine tiny DeepSeek-V4 pack (FP8 dense weights with E8M0 scales, FP4 expert banks) at TP=2 is
built once; each test damages a copy.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from shardsmith.cli import app
from shardsmith.errors import IntegrityError, exit_code_for
from shardsmith.pack.format import dump_yaml, stamp
from shardsmith.writer.split import split_checkpoint

runner = CliRunner()
R0, R1 = "rank-0-of-2", "rank-1-of-2"


@pytest.fixture(scope="module")
def pristine(tiny, tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("faults")
    src = tiny("deepseek-v4")
    return {tp: split_checkpoint(src, root / f"tp{tp}", world_size=tp) and root / f"tp{tp}" for tp in (2, 4)}


@pytest.fixture
def pack(pristine, tmp_path: Path) -> Path:
    out = tmp_path / "pack"
    shutil.copytree(pristine[2], out)
    return out


def _verify(out: Path, *args: str) -> str:
    """Run ``verify --json``; expect exit 2; return the problems, one a line (plus the count line)."""
    r = runner.invoke(app, ["verify", str(out), *args, "--json"])
    assert isinstance(r.exception, IntegrityError) and exit_code_for(r.exception) == 2, r.output
    problems = json.loads(r.stdout)["problems"]
    return f"{len(problems)} problem{'s' if len(problems) != 1 else ''}\n" + "\n".join(problems)


def _tensor(out: Path, rank_dir: str, name: str) -> tuple[Path, dict, dict]:
    m = yaml.safe_load((out / rank_dir / "manifest.yaml").read_text())
    for rec in m["files"]:
        for t in rec["tensors"]:
            if t["name"] == name and (rec["kind"] == "dense" or name in ("gate_up", "down")):
                return out / rank_dir / rec["path"], rec, t
    raise KeyError(name)


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.mark.parametrize("name", ["layers.1.attn.wq_b.weight", "layers.1.attn.wq_b.scale", "gate_up"])
def test_flipped_byte(pack: Path, name: str) -> None:
    path, rec, t = _tensor(pack, R1, name)
    _flip(path, t["offset"] + t["bytes"] // 2)
    where = f"{R1}/{rec['path']}"
    out = _verify(pack)
    assert f"{where}: xxh3_128 expected {rec['xxh3_128']}" in out and out.startswith("1 problem\n")
    out = _verify(pack, "--deep")
    assert f"{where}: tensor '{name}' xxh3_128 expected {t['xxh3_128']}" in out


def test_flipped_byte_in_manifest(pack: Path) -> None:
    p = pack / R0 / "manifest.yaml"
    text = p.read_text()
    i = text.index("xxh3_128: ") + len("xxh3_128: ")
    p.write_text(text[:i] + ("0" if text[i] != "0" else "1") + text[i + 1:])
    out = _verify(pack)
    assert f"{R0}/manifest.yaml: own hash (manifest_xxh3_128) expected" in out


def test_edited_manifest_value(pack: Path) -> None:
    p = pack / R1 / "manifest.yaml"
    m = yaml.safe_load(p.read_text())
    m["files"][0]["tensors"][0]["shape"][0] += 1
    p.write_text(dump_yaml(m))
    assert "own hash (manifest_xxh3_128) expected" in _verify(pack)
    p.write_text(dump_yaml(stamp(m)))  # re-stamped: pack.yaml still records the old hash
    out = _verify(pack)
    assert f"{R1}/manifest.yaml: hash expected" in out and "(pack.yaml)" in out and "from the plan" in out


def test_edited_pack_manifest(pack: Path) -> None:
    p = pack / "pack.yaml"
    doc = yaml.safe_load(p.read_text())
    doc["world_size"] = 4
    p.write_text(dump_yaml(doc))
    assert "pack.yaml: own hash (manifest_xxh3_128) expected" in _verify(pack)


def test_truncated_file(pack: Path) -> None:
    path, rec, _ = _tensor(pack, R0, "gate_up")
    with open(path, "r+b") as f:
        f.truncate(rec["bytes"] - 100)
    assert f"{R0}/{rec['path']}: size expected {rec['bytes']} bytes, found {rec['bytes'] - 100} (truncated)" in _verify(pack)


def test_missing_file(pack: Path) -> None:
    path, rec, _ = _tensor(pack, R1, "down")
    path.unlink()
    assert f"{R1}/{rec['path']}: missing" in _verify(pack)
    (pack / "config.json").unlink()
    assert "config.json: missing (copied file)" in _verify(pack)


def test_extra_file(pack: Path) -> None:
    (pack / R0 / "stray.safetensors").write_bytes(b"x")
    (pack / "notes.txt").write_text("x")
    (pack / "junk").mkdir()
    out = _verify(pack)
    assert f"{R0}/stray.safetensors: unexpected file" in out and "notes.txt: unexpected file" in out
    assert "junk/: unexpected directory" in out


def test_two_ranks_files_swapped(pack: Path) -> None:
    a, b = pack / R0 / "dense-00001.safetensors", pack / R1 / "dense-00001.safetensors"
    tmp = a.with_suffix(".tmp")
    a.rename(tmp), b.rename(a), tmp.rename(b)
    out = _verify(pack)
    for d, other in ((R0, "1"), (R1, "0")):
        assert f"{d}/dense-00001.safetensors: xxh3_128 expected" in out
        assert f"{d}/dense-00001.safetensors: header metadata rank expected '{d[5]}', found '{other}'" in out


def test_rank_of_another_world_size_mixed_in(pack: Path, pristine) -> None:
    shutil.copytree(pristine[4] / "rank-1-of-4", pack / "rank-1-of-4")
    assert "rank-1-of-4: unexpected directory (a rank of world_size=4; this pack has world_size=2)" in _verify(pack)


def test_rank_replaced_by_another_world_size(pack: Path, pristine) -> None:
    shutil.rmtree(pack / R1)
    shutil.copytree(pristine[4] / "rank-1-of-4", pack / R1)
    out = _verify(pack)
    assert f"{R1}/manifest.yaml: world_size expected 2, found 4" in out and f"{R1}/manifest.yaml: pack_id expected" in out


def test_against_catches_a_changed_source(pack: Path, tiny, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny("deepseek-v4"), src)
    from shardsmith.checkpoint import open_checkpoint

    info = open_checkpoint(src).tensors["layers.2.ffn.experts.3.w2.weight"]
    _flip(src / info.file, info.offset + 5)
    out = _verify(pack, "--against", str(src))
    assert "tensor 'layers.2.ffn.experts.3.w2.weight' (rank 0) differs from source" in out
    assert f"source {info.file}: (bytes, xxh3_128) expected" in out


def test_unfinished_split_is_not_a_pack(tmp_path: Path) -> None:
    (tmp_path / "out.partial").mkdir()
    assert "out.partial holds an unfinished split" in _verify(tmp_path / "out")


@pytest.mark.parametrize("deep", [False, True])
def test_duplicate_keys_in_pack_manifest(pack: Path, deep: bool) -> None:
    """``source`` and ``created_by`` written twice, junk first: the loader would keep the second copies,
    whose self-hash still matches, so only the parser can refuse it."""
    p = pack / "pack.yaml"
    p.write_text("source: junk\ncreated_by: junk\n" + p.read_text())
    out = _verify(pack, *(["--deep"] if deep else []))
    assert re.search(r"^pack\.yaml: duplicate keys 'created_by' \(line \d+\), 'source' \(line \d+\)", out, re.M), out


def test_duplicate_key_in_rank_manifest(pack: Path) -> None:
    p = pack / R1 / "manifest.yaml"
    text = p.read_text()
    p.write_text("rank: 0\n" + text)
    out = _verify(pack)
    assert f"{R1}/manifest.yaml: duplicate key 'rank' (line" in out, out


def test_duplicate_key_in_plan(pack: Path) -> None:
    """A second ``world_size`` in ``plan.json`` with every hash recomputed (a forger's edit)."""
    from shardsmith.testing.forge import forge

    pj = pack / "plan.json"
    text = pj.read_text()
    assert text.startswith("{")
    pj.write_text('{"world_size":2,' + text[1:])
    forge(pack)
    out = _verify(pack)
    assert "plan.json: cannot rebuild the plan: duplicate key 'world_size'" in out, out
