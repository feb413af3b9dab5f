"""The pack commands refuse what would destroy data and report bad arguments as usage errors.

Each test runs the real CLI (``typer.testing.CliRunner``) and maps the raised error to its exit
code as ``shardsmith.cli.main`` does: 1 usage/source/plan error, 2 integrity failure. A raw
Python exception (a traceback for the user) fails the test. Checkpoints are copies of the
session's tiny ones.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shardsmith.cli import app
from shardsmith.errors import ShardsmithError, exit_code_for
from shardsmith.writer.split import split_checkpoint

runner = CliRunner()


def cli(*args: object) -> tuple[int, str]:
    """Run ``shardsmith ARGS``; return (exit code as ``main`` sets it, message)."""
    r = runner.invoke(app, [str(a) for a in args])
    if r.exception is None or isinstance(r.exception, SystemExit):
        return (1 if r.exit_code == 2 else r.exit_code), r.output
    assert isinstance(r.exception, ShardsmithError), f"raw {type(r.exception).__name__}: {r.exception}"
    return exit_code_for(r.exception), str(r.exception)


def digest(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``root`` (symlinks followed)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def ckpt(tiny, tmp_path: Path) -> Path:
    src = tmp_path / "ck"
    shutil.copytree(tiny("mixtral"), src)
    return src


@pytest.fixture(scope="module")
def pack(tiny, tmp_path_factory) -> Path:
    """A TP=2 pack of the tiny Mixtral (do not modify: copy first)."""
    out = tmp_path_factory.mktemp("safety") / "tm2"
    split_checkpoint(tiny("mixtral"), out, world_size=2)
    return out


# -- split: OUT never destroys the source or foreign folders ---------------------------------


def test_split_refuses_the_checkpoint_itself(ckpt: Path) -> None:
    before = digest(ckpt)
    code, msg = cli("split", ckpt, ckpt, "--tp", 2, "--force")
    assert code == 1 and f"OUT {ckpt} is the checkpoint" in msg
    assert digest(ckpt) == before and not ckpt.with_name("ck.partial").exists()


def test_split_refuses_a_folder_holding_the_checkpoint(tiny, tmp_path: Path) -> None:
    parent = tmp_path / "parent"
    shutil.copytree(tiny("mixtral"), parent / "ck")
    before = digest(parent)
    code, msg = cli("split", parent / "ck", parent, "--tp", 2, "--force")
    assert code == 1 and "contains the checkpoint" in msg
    assert digest(parent) == before


def test_split_refuses_out_inside_the_checkpoint(ckpt: Path) -> None:
    before = digest(ckpt)
    code, msg = cli("split", ckpt, ckpt / "packs" / "tp2", "--tp", 2)
    assert code == 1 and "lies inside the checkpoint" in msg
    assert digest(ckpt) == before and not (ckpt / "packs").exists()


def test_split_refuses_a_symlink_to_the_checkpoint(ckpt: Path, tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(ckpt)
    code, msg = cli("split", ckpt, tmp_path / "link", "--tp", 2, "--force")
    assert code == 1 and "is the checkpoint" in msg and str(ckpt.resolve()) in msg
    assert (ckpt / "config.json").is_file()


def test_split_refuses_out_holding_linked_shards(ckpt: Path, tmp_path: Path) -> None:
    """A Hugging Face cache layout: the snapshot links its shards into ../../blobs."""
    blobs, snap = tmp_path / "hf" / "blobs", tmp_path / "hf" / "snapshots" / "x"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in ckpt.iterdir():
        shutil.copy(f, blobs / f.name)
        (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    before = digest(blobs)
    code, msg = cli("split", snap, blobs, "--tp", 2, "--force")
    assert code == 1 and "contains source shard" in msg
    assert digest(blobs) == before


def test_split_force_replaces_only_a_pack_or_an_empty_folder(ckpt: Path, tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    code, msg = cli("split", ckpt, mine, "--tp", 2, "--force")
    assert code == 1 and f"{mine}: exists, is not empty and is not a shardsmith pack" in msg
    assert (mine / "notes.txt").read_text() == "keep" and not (tmp_path / "mine.partial").exists()
    (tmp_path / "file").write_text("x")
    code, msg = cli("split", ckpt, tmp_path / "file", "--tp", 2, "--force")
    assert code == 1 and "is not a directory" in msg and (tmp_path / "file").read_text() == "x"

    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli("split", ckpt, empty, "--tp", 2, "--force")[0] == 0
    assert cli("split", ckpt, empty, "--tp", 2)[0] == 1  # a pack now: replaced only with --force
    assert cli("split", ckpt, empty, "--tp", 4, "--force")[0] == 0
    assert (empty / "rank-3-of-4").is_dir() and not (empty / "rank-1-of-2").exists()


def test_split_refuses_a_foreign_partial_folder(ckpt: Path, tmp_path: Path) -> None:
    foreign = tmp_path / "out.partial"
    foreign.mkdir()
    (foreign / "data.bin").write_text("not ours")
    for extra in ((), ("--resume",)):
        code, msg = cli("split", ckpt, tmp_path / "out", "--tp", 2, *extra)
        assert code == 1 and f"{foreign}: exists and is not a partial split" in msg
        assert (foreign / "data.bin").read_text() == "not ours" and not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, flag", [
    (("--tp", 2, "--workers", -1), "--workers -1"),
    (("--tp", 0), "--tp must be at least 1, got 0"),  # as `plan --tp 0` says it
    (("--tp", -2), "--tp must be at least 1, got -2"),
    (("--tp", 2, "--align", 0), "--align must be at least 1, got 0"),
    (("--tp", 2, "--max-file-bytes", 0), "--max-file-bytes 0"),
    (("--tp", 2, "--ranks", "2"), "--ranks 2"),
    (("--tp", 2, "--ranks", "-1"), "--ranks -1"),
])
def test_split_bad_arguments_leave_nothing(ckpt: Path, tmp_path: Path, args: tuple, flag: str) -> None:
    code, msg = cli("split", ckpt, tmp_path / "out", *args)
    assert code == 1 and flag in msg
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


# -- export / import: usage errors, not tracebacks; damage is caught on export ----------------


def test_import_missing_or_folder_archive(tmp_path: Path) -> None:
    code, msg = cli("import", tmp_path / "nonexist.tar.zst", tmp_path / "imp" / "x")
    assert code == 1 and f"{tmp_path / 'nonexist.tar.zst'}: no such archive" in msg
    code, msg = cli("import", tmp_path, tmp_path / "imp" / "x")
    assert code == 1 and "not a file" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_export_bad_archive_paths(pack: Path, tmp_path: Path) -> None:
    code, msg = cli("export", pack, "--rank", 0, tmp_path / "no" / "dir" / "a.tar.zst")
    assert code == 1 and f"{tmp_path / 'no' / 'dir'} does not exist" in msg
    code, msg = cli("export", pack, "--rank", 0, tmp_path)
    assert code == 1 and f"{tmp_path}: is a directory" in msg
    code, msg = cli("export", pack, "--rank", 0, pack / "r0.tar.zst")
    assert code == 1 and "lies inside the pack" in msg
    code, msg = cli("export", pack, "--rank", 2, tmp_path / "a.tar.zst")
    assert code == 1 and "--rank 2: outside [0, 2)" in msg
    code, msg = cli("export", tmp_path / "nopack", "--rank", 0, tmp_path / "a.tar.zst")
    assert code == 1 and "no such pack directory" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == [] and "r0.tar.zst" not in {p.name for p in pack.iterdir()}


def test_export_refuses_to_overwrite_without_force(pack: Path, tmp_path: Path) -> None:
    archive = tmp_path / "r0.tar.zst"
    archive.write_bytes(b"an older archive")
    code, msg = cli("export", pack, "--rank", 0, archive)
    assert code == 1 and f"{archive}: exists (pass --force" in msg and archive.read_bytes() == b"an older archive"
    assert cli("export", pack, "--rank", 0, archive, "--force")[0] == 0
    assert cli("import", archive, tmp_path / "node0")[0] == 0


def test_export_catches_a_corrupted_rank(pack: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(pack, bad)
    victim = sorted((bad / "rank-1-of-2").glob("*.safetensors"))[-1]
    data = bytearray(victim.read_bytes())
    data[-7] ^= 0x40  # in the tensor data; same size
    victim.write_bytes(bytes(data))
    code, msg = cli("export", bad, "--rank", 1, tmp_path / "r1.tar.zst")
    assert code == 2 and str(victim) in msg and "xxh3_128" in msg
    assert not (tmp_path / "r1.tar.zst").exists() and not (tmp_path / "r1.tar.zst.partial").exists()
    assert cli("export", bad, "--rank", 0, tmp_path / "r0.tar.zst")[0] == 0  # the other rank is intact


# -- verify: usage errors exit 1, damage exits 2 with a leading line where it helps ------------


def test_verify_usage_errors(pack: Path, ckpt: Path, tmp_path: Path) -> None:
    code, msg = cli("verify", tmp_path / "nonexistent")
    assert code == 1 and f"{tmp_path / 'nonexistent'}: no such directory" in msg
    code, msg = cli("verify", ckpt)
    assert code == 1 and "this looks like a checkpoint (config.json + safetensors), not a pack" in msg
    assert "`shardsmith split`" in msg and "--against CKPT" in msg
    code, msg = cli("verify", pack, "--rank", 5)
    assert code == 1 and "--rank 5: outside [0, 2)" in msg
    code, msg = cli("verify", pack, "--against", tmp_path / "nonexistent")
    assert code == 1 and f"--against {tmp_path / 'nonexistent'}: no such checkpoint directory" in msg
    code, msg = cli("verify", pack, "--against", pack)
    assert code == 1 and "is a pack" in msg


def test_verify_damage_still_exits_2(pack: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(pack, bad)
    (bad / "pack.yaml").unlink()  # a pack that lost its manifest is damaged, not a usage error
    code, msg = cli("verify", bad)
    assert code == 2 and "pack.yaml" in msg


def test_verify_partial_pack_hints_at_rank(ckpt: Path, pack: Path, tmp_path: Path) -> None:
    assert cli("split", ckpt, tmp_path / "some", "--tp", 4, "--ranks", "1,2")[0] == 0
    code, msg = cli("verify", tmp_path / "some")
    assert code == 2 and "this pack holds ranks [1, 2] only; pass --rank R to check one" in msg
    assert "rank-0-of-4: missing" in msg
    assert cli("verify", tmp_path / "some", "--rank", 2)[0] == 0

    assert cli("export", pack, "--rank", 1, tmp_path / "r1.tar.zst")[0] == 0
    assert cli("import", tmp_path / "r1.tar.zst", tmp_path / "node1")[0] == 0
    code, msg = cli("verify", tmp_path / "node1")
    assert code == 2 and "holds ranks [1] only; pass --rank R" in msg
    assert cli("verify", tmp_path / "node1", "--rank", 1)[0] == 0


def test_verify_against_another_model_says_so_in_one_line(pack: Path, tiny) -> None:
    code, msg = cli("verify", pack, "--against", tiny("deepseek-v3"))
    lead, *rest = msg.splitlines()
    assert code == 2 and "is another checkpoint, not the source of this pack" in lead
    assert "architecture: pack.yaml records 'MixtralForCausalLM'" in lead and "no tensor compared" in lead
    assert len(rest) <= 10 and not any("differs from source" in line for line in rest)
    assert cli("verify", pack, "--against", tiny("mixtral"))[0] == 0


def test_verify_against_same_model_other_weights(pack: Path, tiny) -> None:
    """Same architecture, other files (tied embeddings): still named another checkpoint, not hundreds of diffs."""
    code, msg = cli("verify", pack, "--against", tiny("mixtral-tied"))
    assert code == 2 and "is another checkpoint" in msg.splitlines()[0] and len(msg.splitlines()) <= 11


# -- checkpoint: a dangling shard symlink is named as one -------------------------------------


def test_dangling_shard_symlink_is_named(ckpt: Path, tmp_path: Path) -> None:
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    shard.unlink()
    shard.symlink_to(tmp_path / "gone" / shard.name)
    code, msg = cli("split", ckpt, tmp_path / "out", "--tp", 2)
    assert code == 1 and f"{shard} is a broken symlink to {tmp_path / 'gone' / shard.name}" in msg
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
