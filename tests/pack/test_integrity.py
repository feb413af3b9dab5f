"""Issue 17 holes #1-#4 and #11, one test each, on fresh copies of a tiny TP=2 Mixtral pack.

#1 symbolic links anywhere under the pack root; #2 manifest paths outside the pack (``verify`` in
every mode and ``export``); #3 the loader and ``verify --against`` given such paths; #4 damaged
manifests end as exit 2 naming file and field; fields other evidence contradicts; the root
digest that ``split`` prints and ``verify --expect`` / the loader pin; #11 verified loads by default.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import xxhash
from typer.testing import CliRunner

from shardsmith.cli import app
from shardsmith.errors import IntegrityError, ManifestError, ShardsmithError, exit_code_for
from shardsmith.pack.format import hash_file, root_digest
from shardsmith.pack.reader import open_rank
from shardsmith.testing.forge import forge, load
from shardsmith.writer.split import split_checkpoint

runner = CliRunner()
R0 = "rank-0-of-2"


@pytest.fixture(scope="module")
def pristine(tiny, tmp_path_factory) -> tuple[Path, Path]:
    src = tiny("mixtral")
    out = tmp_path_factory.mktemp("integrity") / "tp2"
    split_checkpoint(src, out, world_size=2)
    return src, out


@pytest.fixture
def pack(pristine, tmp_path: Path) -> Path:
    shutil.copytree(pristine[1], tmp_path / "pack")
    return tmp_path / "pack"


def _fails(args: list[str], *needles: str) -> str:
    """Run the CLI; expect exit 2 (an error class of code 2, no other exception); return its message."""
    r = runner.invoke(app, args)
    assert isinstance(r.exception, ShardsmithError) and exit_code_for(r.exception) == 2, (r.exception, r.output[-2000:])
    text = str(r.exception)
    for n in needles:
        assert n in text, text
    return text


def _verify_all_modes(pack: Path, src: Path, *needles: str) -> None:
    for mode in ([], ["--deep"], ["--against", str(src)]):
        _fails(["verify", str(pack), *mode], *needles)


def _dense(pack: Path, rank: int = 0) -> Path:
    return next((pack / f"rank-{rank}-of-2").glob("dense-*.safetensors"))


# ------------------------------------------------------------------ 1: symbolic links


@pytest.mark.parametrize("what", ["dense", "rank-dir", "manifest", "pack.yaml", "passwd"])
def test_symlinks_are_refused(pristine, pack: Path, tmp_path: Path, what: str) -> None:
    src, _ = pristine
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = {"dense": _dense(pack), "rank-dir": pack / R0, "manifest": pack / R0 / "manifest.yaml",
              "pack.yaml": pack / "pack.yaml", "passwd": None}[what]
    if victim is None:
        (pack / R0 / "passwd").symlink_to("/etc/passwd")
    elif victim.is_dir():
        shutil.copytree(victim, outside / victim.name)
        shutil.rmtree(victim)
        victim.symlink_to(outside / victim.name, target_is_directory=True)
    else:
        shutil.copyfile(victim, outside / victim.name)  # an identical copy: only the link is wrong
        victim.unlink()
        victim.symlink_to(outside / victim.name)
    _verify_all_modes(pack, src, "symbolic link")
    if what != "passwd":  # the loader opens only what the manifests name
        with pytest.raises((IntegrityError, ManifestError), match="symbolic link"):
            open_rank(pack, 0, 2)


# ------------------------------------------------------------------ 2: paths outside the pack


@pytest.mark.parametrize("rel", ["../../../../../../../../../../../../etc/passwd", "../config.json", "/etc/passwd"])
def test_copied_file_outside_the_pack(pristine, pack: Path, tmp_path: Path, rel: str) -> None:
    src, _ = pristine
    shutil.copyfile(pack / "config.json", pack.parent / "config.json")
    target = Path(os.path.normpath(pack / rel))
    size, digest = hash_file(target)
    forge(pack, doc=lambda d: d["copied_files"].append({"path": rel, "bytes": size, "xxh3_128": digest}))
    _verify_all_modes(pack, src, "field copied_files[1].path")
    archive = tmp_path / "r0.tar.zst"
    _fails(["export", str(pack), str(archive), "--rank", "0"], "copied_files[1].path")
    assert not archive.exists()


# ------------------------------------------------------------------ 3: the loader and --against


@pytest.mark.parametrize("rel", ["../../x.safetensors", "sub/x.safetensors", "/tmp/x.safetensors"])
def test_rank_file_outside_the_pack(pristine, pack: Path, rel: str) -> None:
    src, _ = pristine
    m = load(pack / R0 / "manifest.yaml")
    victim = pack / R0 / m["files"][0]["path"]
    target = Path(os.path.normpath(pack / R0 / rel))
    if not rel.startswith("/"):
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(victim, target)

    def edit(r: int, m: dict) -> None:
        if r == 0:
            m["files"][0]["path"] = rel
    forge(pack, rank=edit)
    for kw in ({}, {"verify_hashes": True}, {"verify": False}):
        with pytest.raises(ManifestError, match=r"files\[0\]\.path"):
            open_rank(pack, 0, 2, **kw)
    _verify_all_modes(pack, src, "files[0].path")


# ------------------------------------------------------------------ 4: damaged manifests, contradicted fields


def _rename_key(pack: Path, old: str, new: str) -> None:
    p = pack / R0 / "manifest.yaml"
    text = p.read_text()
    assert f" {old}:" in text
    p.write_text(text.replace(f" {old}:", f" {new}:", 1))


@pytest.mark.parametrize("old,new,field", [("bytes", "byt%s", "files[0].bytes"), ("offset", "ofFset", "files[0].tensors[0].offset")])
def test_renamed_key_names_file_and_field(pack: Path, old: str, new: str, field: str) -> None:
    _rename_key(pack, old, new)
    _fails(["verify", str(pack)], f"{R0}/manifest.yaml: field {field}: missing", f"{R0}/manifest.yaml: own hash")
    forge(pack)  # hashes recomputed: the schema still names it
    _fails(["verify", str(pack), "--deep"], f"{R0}/manifest.yaml: field {field}: missing")
    with pytest.raises(ManifestError, match=re.escape(field)):
        open_rank(pack, 0, 2)
    _rename_key(pack, new, old)
    forge(pack, rank=lambda r, m: m["files"][0]["tensors"][0].update(extra=1) if r == 0 else None)
    _fails(["verify", str(pack)], f"{R0}/manifest.yaml: field files[0].tensors[0]: unknown key 'extra'")


@pytest.mark.parametrize("frac", [0.1, 0.35, 0.6, 0.9])
def test_truncated_manifest(pack: Path, frac: float) -> None:
    p = pack / R0 / "manifest.yaml"
    text = p.read_text()
    p.write_text(text[: int(len(text) * frac)])
    _fails(["verify", str(pack)], f"{R0}/manifest.yaml")
    _fails(["verify", str(pack), "--deep"], f"{R0}/manifest.yaml")
    with pytest.raises(ManifestError, match="manifest.yaml"):
        open_rank(pack, 0, 2)


@pytest.mark.parametrize("value", ["x", [], {}, -4096, 2 ** 70, True])
def test_wrong_type_in_a_tensor_record(pack: Path, value) -> None:
    forge(pack, rank=lambda r, m: m["files"][0]["tensors"][0].update(offset=value) if r == 0 else None)
    _fails(["verify", str(pack)], f"{R0}/manifest.yaml: field files[0].tensors[0].offset")


@pytest.mark.parametrize("value", ["2024-01-01", "!!binary aGVsbG8=", "!!set {a, b}"])
def test_non_json_yaml_values(pack: Path, value: str) -> None:
    p = pack / "pack.yaml"
    p.write_text(p.read_text().replace("format: shardsmith-pack", f"format: {value}", 1))
    _fails(["verify", str(pack)], "pack.yaml: field format")


def test_plan_shard_dim_edit(pristine, pack: Path) -> None:
    """plan.json's shard_dim 1 -> 2 on a 2-D tensor: named, never an IndexError (before and after forging)."""
    src, _ = pristine
    d = json.loads((pack / "plan.json").read_bytes())
    name = next(n for n, t in d["tensors"].items() if t["shard_dim"] == 1 and len(t["shape"]) == 2)
    d["tensors"][name]["shard_dim"] = 2
    (pack / "plan.json").write_bytes(json.dumps(d, separators=(",", ":")).encode())
    _fails(["verify", str(pack)], "plan.json: (bytes, xxh3_128) expected")
    forge(pack)
    _verify_all_modes(pack, src, f"plan.json: tensor {name!r}: shard_dim 2 outside shape")
    with pytest.raises(IntegrityError, match="shard_dim 2 outside"):
        open_rank(pack, 0, 2)


@pytest.mark.parametrize("edit,needle", [
    (lambda d: d.update(world_size=16777216), "field world_size: 16777216 outside [1, 4096]"),
    (lambda d: d["ranks"][0].update(rank=1), "field ranks[0].rank: 1, but it is entry 0"),
    (lambda d: d["plan"].update(file="other.json"), "field plan.file: 'other.json'"),
    (lambda d: d.update(ranks_written=[0]), "field ranks_written: [0], but ranks records a manifest hash for ranks [0, 1]"),
    (lambda d: d["ranks"][1].update(dir="rank-0-of-2"), "field ranks[1].dir"),
    (lambda d: d.update(pack_id="0" * 32), "field pack_id"),
])
def test_contradicted_pack_fields(pack: Path, edit, needle: str) -> None:
    forge(pack, doc=edit)
    _fails(["verify", str(pack)], needle)
    with pytest.raises(ManifestError, match="pack.yaml"):
        open_rank(pack, 0, 2)


def test_rank_directories_renamed(pack: Path) -> None:
    a, b = pack / R0, pack / "rank-1-of-2"
    a.rename(pack / "tmp"), b.rename(a), (pack / "tmp").rename(b)
    _fails(["verify", str(pack)], f"{R0}/manifest.yaml: rank expected 0, found 1")


# ------------------------------------------------------------------ root digest


def test_root_digest_pins_the_pack(pristine, tmp_path: Path) -> None:
    src, _ = pristine
    out = tmp_path / "p"
    r = runner.invoke(app, ["split", str(src), str(out), "--tp", "2", "--json"])
    assert r.exit_code == 0, r.output
    digest = json.loads(r.stdout)["root_digest"]
    assert digest == xxhash.xxh3_128((out / "pack.yaml").read_bytes()).hexdigest() == root_digest((out / "pack.yaml").read_bytes())
    assert runner.invoke(app, ["verify", str(out), "--expect", digest]).exit_code == 0
    assert open_rank(out, 1, 2, expect_digest=digest).rank == 1
    forge(out, doc=lambda d: d.update(created_by="someone else"))  # a deliberate, self-consistent edit
    assert runner.invoke(app, ["verify", str(out)]).exit_code == 0  # only the pinned digest can tell
    _fails(["verify", str(out), "--expect", digest], f"root digest expected {digest}")
    with pytest.raises(ManifestError, match="root digest expected"):
        open_rank(out, 0, 2, expect_digest=digest)
    _fails(["generate", str(out), "--prompt", "x", "--expect-digest", digest], "root digest expected")
    typo = runner.invoke(app, ["verify", str(out), "--expect", "abc"])  # not a digest: a usage error, not damage
    assert typo.exit_code == 1 and "--expect takes the root digest split printed (32 hex digits), got 'abc'" in str(typo.exception)


# ------------------------------------------------------------------ 11: verified loads by default


def test_flipped_dense_byte_refused_at_load(pack: Path) -> None:
    m = load(pack / R0 / "manifest.yaml")
    rec = next(f for f in m["files"] if f["kind"] == "dense")
    t = rec["tensors"][len(rec["tensors"]) // 2]
    with open(pack / R0 / rec["path"], "r+b") as f:
        f.seek(t["offset"] + 1)
        b = f.read(1)
        f.seek(t["offset"] + 1)
        f.write(bytes([b[0] ^ 1]))
    rp = open_rank(pack, 0, 2)  # sizes and headers are fine: nothing read yet
    with pytest.raises(IntegrityError, match=f"{R0}/{rec['path']}: xxh3_128 expected {rec['xxh3_128']}"):
        rp.dense()
    assert open_rank(pack, 0, 2, verify=False).dense()[t["name"]].numel() > 0  # --no-verify loads it


def test_flipped_bank_byte_refused_by_host_banks(pack: Path) -> None:
    from shardsmith.runtime.offload.host_bank import load_host_banks

    m = load(pack / R0 / "manifest.yaml")
    rec = next(f for f in m["files"] if f["kind"] == "bank")
    t = rec["tensors"][-1]
    with open(pack / R0 / rec["path"], "r+b") as f:
        f.seek(t["offset"] + t["bytes"] - 1)
        b = f.read(1)
        f.seek(t["offset"] + t["bytes"] - 1)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(IntegrityError, match=f"bank array {t['name']!r} xxh3_128 expected {t['xxh3_128']}"):
        load_host_banks(open_rank(pack, 0, 2), pin="off")
    with pytest.raises(IntegrityError, match=rec["path"]):
        open_rank(pack, 0, 2).banks()
    hb = load_host_banks(open_rank(pack, 0, 2, verify=False), pin="off")
    assert set(hb.layers) == {f["layer"] for f in m["files"] if f["kind"] == "bank"}
