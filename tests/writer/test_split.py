"""split then verify on tiny real-format checkpoints of every family, and split's refusals.

Each case splits with the library, then runs ``shardsmith verify --deep --against SRC`` through
the CLI (exit 0 expected), which rebuilds every source tensor from the rank slices.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import xxhash
import yaml
from safetensors import safe_open
from typer.testing import CliRunner

from shardsmith.cli import app
from shardsmith.errors import SourceError, UsageError
from shardsmith.writer.split import split_checkpoint
from shardsmith.pack.format import Entry, layout_file
from shardsmith.writer.stwriter import FileWriter
from shardsmith.writer.verify import verify_pack

runner = CliRunner()

CASES = [(name, tp) for name, tps in {
    "deepseek-v4": (1, 2, 4), "deepseek-v3": (1, 2, 4), "mixtral": (1, 2, 3, 4), "mixtral-fp8": (1, 2, 3, 4),
    "qwen3-moe": (2, 3), "qwen2-moe": (2,),
}.items() for tp in tps]


@pytest.mark.parametrize("name,tp", CASES, ids=[f"{n}-tp{t}" for n, t in CASES])
def test_split_then_verify_against(tiny, tmp_path: Path, name: str, tp: int) -> None:
    src = tiny(name)
    out = tmp_path / "pack"
    res = split_checkpoint(src, out, world_size=tp, max_file_bytes=1 << 20)
    assert res.bytes_read == sum(f.stat().st_size for f in src.glob("*.safetensors")) - sum(
        8 + int.from_bytes(f.read_bytes()[:8], "little") for f in src.glob("*.safetensors"))  # every tensor byte, once
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [f"rank-{r}-of-{tp}" for r in range(tp)]
    assert not out.with_name("pack.partial").exists()
    r = runner.invoke(app, ["verify", str(out), "--deep", "--against", str(src), "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["ok"] and rep["tensors_compared"] > 0 and rep["ranks"] == list(range(tp))


def test_pack_schema_matches_readme(tiny, tmp_path: Path) -> None:
    """pack.yaml / manifest.yaml carry the keys manifests/README.md documents."""
    out = tmp_path / "pack"
    split_checkpoint(tiny("deepseek-v4"), out, world_size=2)
    pack = yaml.safe_load((out / "pack.yaml").read_text())
    assert list(pack) == ["format", "format_version", "world_size", "created_by", "source", "plan", "copied_files",
                          "ranks", "ranks_written", "pack_id", "manifest_xxh3_128"]
    assert pack["format"] == "shardsmith-pack" and pack["format_version"] == 1
    assert set(pack["source"]) == {"architecture", "family", "files"}
    assert set(pack["plan"]) == {"file", "bytes", "xxh3_128", "family", "align", "notes"}
    assert pack["plan"]["xxh3_128"] == xxhash.xxh3_128((out / "plan.json").read_bytes()).hexdigest()
    m = yaml.safe_load((out / "rank-1-of-2" / "manifest.yaml").read_text())
    assert list(m) == ["format", "format_version", "rank", "world_size", "pack_id", "files", "manifest_xxh3_128"]
    assert m["pack_id"] == pack["pack_id"] and pack["ranks"][1]["manifest_xxh3_128"] == m["manifest_xxh3_128"]
    bank = next(f for f in m["files"] if f["kind"] == "bank")
    assert set(bank) == {"path", "kind", "layer", "bytes", "xxh3_128", "tensors"}
    assert [t["name"] for t in bank["tensors"]] == ["gate_up", "gate_up_scale", "down", "down_scale"]
    assert all(t["offset"] % 4096 == 0 for t in bank["tensors"])
    assert set(bank["tensors"][0]) == {"name", "dtype", "shape", "offset", "bytes", "xxh3_128"}
    dense = next(f for f in m["files"] if f["kind"] == "dense")
    with safe_open(out / "rank-1-of-2" / dense["path"], "pt") as f:
        assert f.metadata() == {"format": "shardsmith-pack", "format_version": "1", "rank": "1", "world_size": "2", "kind": "dense"}


def test_stwriter_out_of_order_loads_with_safetensors(tmp_path: Path) -> None:
    tensors = {"a": torch.randn(3, 5).bfloat16(), "b": torch.randn(7).to(torch.float8_e4m3fn),
               "c": torch.randn(2, 9), "d": torch.arange(6, dtype=torch.int64).reshape(2, 3), "e": torch.zeros(0)}
    from shardsmith.dtypes import dtype_name

    entries = [Entry(n, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size()) for n, t in tensors.items()]
    for align in (64, 4096):
        lay = layout_file(entries, align=align, metadata={"rank": "0"})
        path = tmp_path / f"x{align}.safetensors"
        w = FileWriter(path, lay)
        for e in reversed(lay.entries):  # out of order: hashing reads back
            w.write(e.offset, tensors[e.name].contiguous().view(torch.uint8).numpy().tobytes())
        digest = w.finish()
        raw = path.read_bytes()
        assert digest.xxh3_128 == xxhash.xxh3_128(raw).hexdigest() and digest.size == len(raw)
        assert lay.data_start % 4096 == 0 and all(e.offset % align == 0 for e in lay.entries)
        for e in lay.entries:
            assert digest.tensors[e.name] == xxhash.xxh3_128(raw[e.offset:e.offset + e.nbytes]).hexdigest()
        with safe_open(path, "pt") as f:
            assert f.metadata() == {"rank": "0"}
            for n, t in tensors.items():
                assert torch.equal(f.get_tensor(n).view(torch.uint8), t.view(torch.uint8)), n


def test_refuses_header_only_checkpoint(tiny, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny("qwen3-moe"), src)
    shard = sorted(src.glob("*.safetensors"))[0]
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    (src / (shard.name + ".json")).write_bytes(raw[8:8 + n])
    shard.unlink()
    with pytest.raises(SourceError, match="header-only"):
        split_checkpoint(src, tmp_path / "out", world_size=2)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_refuses_non_empty_out_unless_force(tiny, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for force in (False, True):  # not a pack: no hint to --force, which replaces only a pack
        with pytest.raises(UsageError, match="not empty and is not a shardsmith pack"):
            split_checkpoint(tiny("qwen3-moe"), out, world_size=2, force=force)
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    split_checkpoint(tiny("qwen3-moe"), out, world_size=2)
    with pytest.raises(UsageError, match="holds a pack .pass --force to replace it"):
        split_checkpoint(tiny("qwen3-moe"), out, world_size=2)
    split_checkpoint(tiny("qwen3-moe"), out, world_size=2, force=True)
    assert verify_pack(out).ok


def test_some_ranks_only(tiny, tmp_path: Path) -> None:
    src, out = tiny("deepseek-v3"), tmp_path / "out"
    r = runner.invoke(app, ["split", str(src), str(out), "--tp", "4", "--ranks", "1,2", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["ranks"] == [1, 2]
    pack = yaml.safe_load((out / "pack.yaml").read_text())
    assert [x["rank"] for x in pack["ranks"]] == [0, 1, 2, 3] and pack["ranks_written"] == [1, 2]
    assert pack["ranks"][0]["manifest_xxh3_128"] is None
    for rank in (1, 2):
        assert verify_pack(out, rank=rank, deep=True, against=src).ok
    rep = verify_pack(out)
    assert any("rank-0-of-4: missing" in p for p in rep.problems) and any("rank-3-of-4: missing" in p for p in rep.problems)
    bad = runner.invoke(app, ["split", str(src), str(tmp_path / "o2"), "--tp", "4", "--ranks", "4"])
    assert bad.exit_code != 0


def test_copies_non_weight_files(tiny, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny("qwen3-moe"), src)
    extra = {"tokenizer.json": "{}", "tokenizer_config.json": "{}", "chat_template.jinja": "{{ x }}",
             "generation_config.json": "{}", "special_tokens_map.json": "{}", "inference/config.json": "{}",
             "inference/model.py": "# code", "encoding/encoding_dsv4.py": "# code", "LICENSE": "MIT"}
    for rel, text in extra.items():
        (src / rel).parent.mkdir(exist_ok=True)
        (src / rel).write_text(text)
    (src / ".hidden").write_text("no")
    (src / "original").mkdir()
    (src / "original" / "consolidated.pth").write_text("no")
    out = tmp_path / "out"
    split_checkpoint(src, out, world_size=2)
    copied = {c["path"] for c in yaml.safe_load((out / "pack.yaml").read_text())["copied_files"]}
    assert copied == set(extra) | {"config.json"}
    for rel in copied:
        assert (out / rel).read_bytes() == (src / rel).read_bytes()
    assert not (out / ".hidden").exists() and not (out / "original").exists()
    assert not any(out.glob("*.safetensors*")) and verify_pack(out, deep=True).ok
