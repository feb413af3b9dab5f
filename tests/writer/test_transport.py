"""export/import of one rank as a .tar.zst stream: a verified roundtrip, and damage leaves nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shardsmith.cli import app
from shardsmith.errors import IntegrityError, UsageError
from shardsmith.writer.split import split_checkpoint
from shardsmith.writer.transport import export_rank, import_rank
from shardsmith.writer.verify import verify_pack

runner = CliRunner()


@pytest.fixture(scope="module")
def exported(tiny, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("transport")
    split_checkpoint(tiny("deepseek-v4"), root / "pack", world_size=2)
    r = runner.invoke(app, ["export", str(root / "pack"), str(root / "r1.tar.zst"), "--rank", "1", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["rank"] == 1 and res["ratio"] > 1.0 and res["archive_bytes"] == (root / "r1.tar.zst").stat().st_size
    return root / "pack", root / "r1.tar.zst"


def test_roundtrip_verifies(exported, tiny, tmp_path: Path) -> None:
    pack, archive = exported
    dest = tmp_path / "node1"
    r = runner.invoke(app, ["import", str(archive), str(dest)])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "pack.yaml", "plan.json", "rank-1-of-2"]
    for f in (pack / "rank-1-of-2").iterdir():
        assert (dest / "rank-1-of-2" / f.name).read_bytes() == f.read_bytes()
    rep = verify_pack(dest, rank=1, deep=True, against=tiny("deepseek-v4"))
    assert rep.ok, rep.problems
    assert any("rank-0-of-2: missing" in p for p in verify_pack(dest).problems)
    with pytest.raises(UsageError, match="not empty"):
        import_rank(archive, dest)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_archive_leaves_nothing(exported, tmp_path: Path, damage: str) -> None:
    _, archive = exported
    data = bytearray(archive.read_bytes())
    if damage == "truncate":
        data = data[: len(data) * 2 // 3]
    else:
        data[len(data) // 2] ^= 0xFF
    bad = tmp_path / "bad.tar.zst"
    bad.write_bytes(bytes(data))
    dest = tmp_path / "node"
    with pytest.raises(IntegrityError):
        import_rank(bad, dest)
    assert not dest.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad.tar.zst"]


def test_export_other_rank_and_threads(exported, tmp_path: Path) -> None:
    pack, _ = exported
    res = export_rank(pack, 0, tmp_path / "r0.tar.zst", level=1, threads=1)
    assert res.rank == 0 and res.world_size == 2 and res.files == 10
    assert import_rank(tmp_path / "r0.tar.zst", tmp_path / "n0").rank == 0
    assert verify_pack(tmp_path / "n0", rank=0).ok
