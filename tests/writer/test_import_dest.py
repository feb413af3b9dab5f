"""`import` names what is wrong with its destination: '.', a symlink, an existing file, a full directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shardsmith.cli import app
from shardsmith.errors import UsageError
from shardsmith.writer.split import split_checkpoint
from shardsmith.writer.transport import export_rank, import_rank

runner = CliRunner()


@pytest.fixture(scope="module")
def archive(tiny, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("import-dest")
    split_checkpoint(tiny("mixtral"), root / "pack", world_size=2)
    export_rank(root / "pack", 0, root / "r0.tar.zst")
    return root / "r0.tar.zst"


def _refused(archive: Path, dest: Path, fragment: str, cwd: Path) -> None:
    before = sorted(p.name for p in cwd.iterdir())
    with pytest.raises(UsageError, match=fragment):
        import_rank(archive, dest)
    r = runner.invoke(app, ["import", str(archive), str(dest)], standalone_mode=False)
    assert isinstance(r.exception, UsageError) and fragment in str(r.exception), r.exception
    assert sorted(p.name for p in cwd.iterdir()) == before  # no temporary directory left behind


def test_symlink_to_an_empty_directory(archive: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    _refused(archive, tmp_path / "link", "is a symlink to", tmp_path)


def test_dot(archive: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _refused(archive, Path("."), "names an existing directory by '.'", tmp_path)


def test_existing_plain_file(archive: Path, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("keep me")
    _refused(archive, tmp_path / "f", "exists and is a file, not a directory", tmp_path)
    assert (tmp_path / "f").read_text() == "keep me"


def test_non_empty_directory_and_an_empty_one(archive: Path, tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    _refused(archive, tmp_path / "full", "exists and is not empty", tmp_path)
    (tmp_path / "empty").mkdir()
    r = import_rank(archive, tmp_path / "empty")  # an empty directory is replaced
    assert r.rank == 0 and (tmp_path / "empty" / "pack.yaml").is_file()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]
