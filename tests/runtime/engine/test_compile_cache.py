"""The per-pack compile cache: ``shardsmith warmup`` fills it, a second start compiles nothing, and a cache
made for something else, or damaged, is rebuilt with the reason logged, never fatal.

The end-to-end test compiles for real on the CPU (``SHARDSMITH_KERNELS=compile_pieces=kernel``: the
decode pieces through TorchInductor's C++ backend) at TP=2, so both ranks fill, seal and reuse their
own folders; the file counts come from the folders themselves, as ``benchmarks/ttft.py`` counts them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardsmith.runtime.engine import compile_cache as cc
from shardsmith.testing.tiny import tiny_mixtral
from shardsmith.testing.tokenizer import deepseek_tokenizer
from shardsmith.writer.split import split_checkpoint


def _key(**change) -> cc.CacheKey:
    base = cc.CacheKey(pack="a" * 32, rank=0, world_size=1, dtype="torch.float32", device="cpu x86_64 AVX2",
                       torch="2.13.0+cpu", triton="3.9.0", python="3.11.9", kernels="compile_pieces=kernel")
    return dataclasses.replace(base, **change)


def _fill(cache: cc.CompileCache) -> list[Path]:
    """Write files where Triton and TorchInductor would (a kernel folder, a graph entry)."""
    files = [cache.folder / "triton" / "K3Y" / "kernel.so", cache.folder / "inductor" / "fxgraph" / "ab" / "entry"]
    for i, f in enumerate(files):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(bytes([i + 1]) * (100 + i))
    return files


@pytest.fixture
def pack_path(tmp_path: Path) -> Path:
    p = tmp_path / "pack"
    p.mkdir()
    return p


def test_reused_when_the_key_and_every_file_match(tmp_path: Path, pack_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    root = tmp_path / "compile"
    cache = cc.open_cache(root, pack_path, _key())
    assert cache.state == "new" and os.environ["TRITON_CACHE_DIR"] == str(cache.folder / "triton")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache.folder / "inductor")
    _fill(cache)
    assert cache.seal() == 2
    again = cc.open_cache(root, pack_path, _key())
    assert (again.state, again.why, again.files_at_open, again.folder) == ("reused", "", 2, cache.folder)


def test_a_seal_hashes_only_the_files_it_has_not_checked(tmp_path: Path, pack_path: Path, monkeypatch) -> None:
    """A bucket built while idle seals again: the files checked at open or at the last seal keep their
    hashes, new ones (and one whose size changed) are read; the next open still checks every file."""
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    root = tmp_path / "compile"
    first = cc.open_cache(root, pack_path, _key())
    old = _fill(first)
    first.seal()
    read: list[str] = []
    real_hash = cc._hash
    monkeypatch.setattr(cc, "_hash", lambda p: read.append(p.name) or real_hash(p))
    cache = cc.open_cache(root, pack_path, _key())
    assert sorted(read) == ["entry", "kernel.so"]  # the open checks every recorded file
    read.clear()
    new = cache.folder / "triton" / "N3W" / "bucket.so"
    new.parent.mkdir(parents=True)
    new.write_bytes(b"x" * 50)
    assert cache.seal() == 3 and read == ["bucket.so"]
    read.clear()
    old[1].write_bytes(b"y" * 7)  # a size change is read again, and recorded as it is now
    assert cache.seal() == 3 and read == ["entry"]
    record = json.loads((cache.folder / cc.RECORD).read_text())["files"]
    assert record["inductor/fxgraph/ab/entry"] == [7, real_hash(old[1])]
    assert cc.open_cache(root, pack_path, _key()).state == "reused"


@pytest.mark.parametrize(("change", "made"), [
    ({"dtype": "torch.bfloat16"}, "dtype 'torch.float32' (now 'torch.bfloat16')"),
    ({"torch": "2.14.0", "pack": "b" * 32}, f"pack '{'a' * 32}' (now '{'b' * 32}'), torch '2.13.0+cpu' (now '2.14.0')"),
])
def test_a_cache_made_for_another_key_is_not_used_and_says_why(tmp_path: Path, pack_path: Path, change, made,
                                                                caplog) -> None:
    root = tmp_path / "compile"
    cache = cc.open_cache(root, pack_path, _key())
    files = _fill(cache)
    cache.seal()
    with caplog.at_level("INFO", logger="shardsmith.runtime"):
        other = cc.open_cache(root, pack_path, _key(**change))
    why = f"{cache.folder.name} was made for {made}: not used"
    assert (other.state, other.why) == ("new", why) and other.folder != cache.folder
    assert f"compile cache {other.folder}: new; {why}" in caplog.text
    assert other.files() == {} and all(f.exists() for f in files)  # left alone: another server may use it
    assert os.environ["TRITON_CACHE_DIR"] == str(other.folder / "triton")


def test_a_damaged_or_missing_entry_or_record_is_rebuilt(tmp_path: Path, pack_path: Path) -> None:
    root = tmp_path / "compile"
    cache = cc.open_cache(root, pack_path, _key())
    so, entry = _fill(cache)
    cache.seal()
    so.write_bytes(b"\x01" * 99 + b"\x02")  # same size, other bytes
    again = cc.open_cache(root, pack_path, _key())
    assert (again.state, again.why) == ("rebuilt", "triton/K3Y/kernel.so differs from its record (size or XXH3-64)")
    assert again.files() == {} and sorted(p.name for p in root.iterdir()) == [cache.folder.name]  # moved aside, gone
    _fill(again)
    again.seal()
    entry.unlink()
    assert cc.open_cache(root, pack_path, _key()).why == "inductor/fxgraph/ab/entry is missing"
    _fill(again)
    again.seal()
    (again.folder / cc.RECORD).write_text("{not json")
    third = cc.open_cache(root, pack_path, _key())
    assert third.state == "rebuilt" and third.why.startswith("its record.json cannot be read (JSONDecodeError")
    record = json.loads(json.dumps({"key": dataclasses.asdict(_key(dtype="torch.float16")), "files": {}}))
    (third.folder / cc.RECORD).write_text(json.dumps(record))  # a record that is not this folder's key
    assert cc.open_cache(root, pack_path, _key()).why == "its record was made for dtype 'torch.float16' (now 'torch.float32')"
    (third.folder / cc.RECORD).unlink(missing_ok=True)
    _fill(third)  # no record yet: a start of the same key still warming up; its whole files are used
    unsealed = cc.open_cache(root, pack_path, _key())
    assert (unsealed.state, unsealed.why, unsealed.files_at_open) == ("reused", "", 2)


def test_an_empty_cache_is_removed_at_seal_and_old_folders_are_evicted(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "compile"
    first = cc.open_cache(root, tmp_path / "p0", _key())
    assert first.seal() == 0 and not first.folder.exists()  # nothing compiled (the CPU default): nothing kept
    monkeypatch.setattr(cc, "KEEP_FOLDERS", 3)
    folders = []
    for i in range(5):
        c = cc.open_cache(root, tmp_path / f"p{i}", _key())
        _fill(c)
        c.seal()
        os.utime(c.folder, (1000 + i, 1000 + i))
        folders.append(c.folder)
    c = cc.open_cache(root, tmp_path / "p9", _key())  # the least recently used go
    assert sorted(p.name for p in root.iterdir()) == sorted(f.name for f in [*folders[3:], c.folder])


def test_a_cache_folder_that_cannot_be_written_is_a_slower_start_not_a_failed_one(tmp_path: Path, caplog) -> None:
    from shardsmith.runtime.engine.engine import Engine

    src = tiny_mixtral(tmp_path / "src", layers=1)
    split_checkpoint(src, tmp_path / "out", world_size=1)
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder would go\n")
    with caplog.at_level("WARNING", logger="shardsmith.runtime"):
        engine = Engine.load(tmp_path / "out", rank=0, world_size=1, dtype=torch.float32, max_seq_len=16,
                             max_num_seqs=1, compile_cache=blocked / "compile")
    assert engine.compile_cache is None and "cannot be used" in caplog.text
    engine.warmup()  # nothing to seal: no error either
    assert engine.prefill(0, [1, 2, 3]).shape == (1, engine.vocab_size)


def test_the_key_names_the_pack_by_its_root_digest(tmp_path: Path) -> None:
    from shardsmith.pack.reader import open_pack

    src = tiny_mixtral(tmp_path / "src", layers=1)
    split_checkpoint(src, tmp_path / "out", world_size=1)
    key = cc.make_key(tmp_path / "out", from_checkpoint=False, rank=0, world_size=1, dtype=torch.float32,
                      device=torch.device("cpu"))
    assert key.pack == open_pack(tmp_path / "out").digest
    assert (key.torch, key.dtype) == (torch.__version__, "torch.float32")
    assert key.device.startswith("cpu ") and "compile_pieces=auto" in key.kernels
    ckpt = cc.make_key(src, from_checkpoint=True, rank=0, world_size=1, dtype=torch.float32, device=torch.device("cpu"))
    assert ckpt.pack != key.pack and len(ckpt.pack) == 32


def _warmup(pack: Path, cache: Path, *extra: str) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    env |= {"SHARDSMITH_CACHE": str(cache), "SHARDSMITH_KERNELS": "compile_pieces=kernel"}
    r = subprocess.run([sys.executable, "-m", "shardsmith.cli", "warmup", str(pack), "--device", "cpu", "--dtype",
                        "float32", "--max-num-seqs", "2", "--json", *extra], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout), r.stderr


def _tree(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def test_a_second_start_compiles_nothing(tmp_path: Path) -> None:
    """Two ``warmup`` runs of a TP=2 pack: the second reuses every rank's folder and writes no compiled file
    (a damaged entry's rebuild is :func:`test_a_damaged_or_missing_entry_or_record_is_rebuilt`'s)."""
    src = tiny_mixtral(tmp_path / "src", layers=1)
    deepseek_tokenizer(src, vocab_size=256)
    split_checkpoint(src, tmp_path / "tp2", world_size=2)
    cache = tmp_path / "cache"

    first, _ = _warmup(tmp_path / "tp2", cache)
    folders = sorted((cache / "compile").iterdir())
    assert [f.name.rsplit("-", 2)[1] for f in folders] == ["rank0of2", "rank1of2"]
    assert first["compile_cache"]["state"] == "new" and first["compile_cache"]["files"] > 0
    assert list(first["start_phases_s"]) == ["launcher", "rank_start", "imports", "group"]  # before the load
    trees = [_tree(f) for f in folders]
    for f, tree in zip(folders, trees):  # every rank sealed its folder with each compiled file
        record = json.loads((f / cc.RECORD).read_text())
        assert set(record["files"]) == set(tree) - {cc.RECORD} and any(k.startswith("inductor/") for k in tree)

    second, log = _warmup(tmp_path / "tp2", cache)
    assert second["compile_cache"] | {"folder": None} == {
        "folder": None, "state": "reused", "why": "", "files": first["compile_cache"]["files"],
        "files_at_start": first["compile_cache"]["files"]}
    assert "reused" in log
    # what the cache cannot keep: dynamo traces every start again; the backend (Inductor) reads its output back
    assert second["warmup_compile_s"]["dynamo"] > 0 and first["warmup_compile_s"]["dynamo"] > 0
    assert 0 < second["warmup_compile_s"]["backend"] < first["warmup_compile_s"]["backend"]
    for f, tree in zip(folders, trees):  # no rank wrote a compiled file: the same files, the same sizes
        assert {k: v for k, v in _tree(f).items() if k != cc.RECORD} == {k: v for k, v in tree.items() if k != cc.RECORD}

