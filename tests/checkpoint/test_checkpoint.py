"""Checkpoint reading and eager validation: every malformed input gets its specific error and exit 1."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from shardsmith.checkpoint import open_checkpoint
from shardsmith.cli import app
from shardsmith.errors import SourceError

runner = CliRunner()


def write_raw(path: Path, header: dict | bytes, data: bytes, *, length: int | None = None) -> None:
    """Write a safetensors file with an arbitrary (possibly bad) header."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def make_ckpt(root: Path, header: dict | bytes, data: bytes, *, index: dict | None = None, **kw) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"architectures": ["MixtralForCausalLM"]}))
    name = "model-00001-of-00001.safetensors"
    write_raw(root / name, header, data, **kw)
    if index is None and isinstance(header, dict):
        index = {"weight_map": {k: name for k in header if k != "__metadata__"}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index or {"weight_map": {}}))
    return root


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def expect(root: Path, *fragments: str) -> SourceError:
    """open_checkpoint fails naming every fragment, and `shardsmith inspect` exits 1 saying so."""
    with pytest.raises(SourceError) as exc:
        open_checkpoint(root)
    for f in fragments:
        assert f in str(exc.value), (f, str(exc.value))
    result = runner.invoke(app, ["inspect", str(root)], standalone_mode=False)
    assert isinstance(result.exception, SourceError)
    from shardsmith.errors import exit_code_for

    assert exit_code_for(result.exception) == 1
    return exc.value


def test_valid_checkpoint_reads_tensors_and_slices(tmp_path: Path) -> None:
    a = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    b = torch.arange(8, dtype=torch.int8)
    data = a.numpy().tobytes() + b.numpy().tobytes()
    root = make_ckpt(tmp_path / "c", {"a": entry("F32", [4, 6], 0, 96), "b": entry("I8", [8], 96, 104)}, data)
    ckpt = open_checkpoint(root)
    assert torch.equal(ckpt.read("a"), a)
    assert torch.equal(ckpt.read_slice("a", 1, 2, 3), a[:, 2:5])
    assert torch.equal(ckpt.read_slice("a", 0, 1, 2), a[1:3])
    assert torch.equal(ckpt.read("b"), b)


def test_f4_counts_four_bit_elements(tmp_path: Path) -> None:
    root = make_ckpt(tmp_path / "c", {"w": entry("F4", [2, 8], 0, 8)}, bytes(range(8)))
    ckpt = open_checkpoint(root)
    assert ckpt.tensors["w"].nbytes == 8
    assert ckpt.read_slice("w", 1, 4, 4).tolist() == [[2, 3], [6, 7]]  # bytes, two elements each
    with pytest.raises(SourceError, match="cuts inside a byte"):
        ckpt.read_slice("w", 1, 1, 2)


def test_missing_shard_file(tmp_path: Path) -> None:
    root = make_ckpt(tmp_path / "c", {"a": entry("F32", [1], 0, 4)}, bytes(4),
                     index={"weight_map": {"a": "model-00001-of-00001.safetensors", "b": "model-00002.safetensors"}})
    expect(root, "model-00002.safetensors", "neither it nor model-00002.safetensors.json exists")


def test_header_not_json(tmp_path: Path) -> None:
    root = make_ckpt(tmp_path / "c", b"{not json", b"", index={"weight_map": {"a": "model-00001-of-00001.safetensors"}})
    expect(root, "model-00001-of-00001.safetensors: header is not valid JSON")


def test_overlapping_offsets(tmp_path: Path) -> None:
    root = make_ckpt(tmp_path / "c", {"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, bytes(12))
    expect(root, "tensor 'b' data [4, 12) overlaps the previous tensor")


def test_gap_between_tensors(tmp_path: Path) -> None:
    root = make_ckpt(tmp_path / "c", {"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}, bytes(12))
    expect(root, "gap of 4 bytes before tensor 'b'")


def test_size_does_not_match_dtype_and_shape(tmp_path: Path) -> None:
    root = make_ckpt(tmp_path / "c", {"a": entry("BF16", [3, 2], 0, 8), "w": entry("F4", [4, 4], 8, 24)}, bytes(24))
    err = expect(root, "tensor 'a' BF16[3, 2] needs 12 bytes but data_offsets [0, 8] span 8",
                 "tensor 'w' F4[4, 4] needs 8 bytes")
    assert len(err.problems) == 2  # every problem reported at once


def test_truncated_shard_names_first_tensor_past_end(tmp_path: Path) -> None:
    header = {"a": entry("F32", [4], 0, 16), "b": entry("F32", [4], 16, 32), "c": entry("F32", [4], 32, 48)}
    root = make_ckpt(tmp_path / "c", header, bytes(20))
    expect(root, "truncated: 20 data bytes on disk but tensors need 48", "first tensor past the end: 'b'")


def test_duplicate_tensor_names(tmp_path: Path) -> None:
    raw = b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}'
    root = make_ckpt(tmp_path / "c", raw, bytes(8), index={"weight_map": {"a": "model-00001-of-00001.safetensors"}})
    expect(root, "duplicate tensor name 'a'")


def test_duplicate_keys_in_config_and_index(tmp_path: Path) -> None:
    """JSON keeps the last of two equal keys silently; the source's JSON files refuse them, named."""
    root = make_ckpt(tmp_path / "c", {"a": entry("F32", [1], 0, 4)}, bytes(4))
    (root / "config.json").write_text('{"architectures": ["MixtralForCausalLM"], "num_local_experts": 8, '
                                      '"num_local_experts": 4}')
    idx = '{"weight_map": {"a": "model-00001-of-00001.safetensors", "a": "model-00001-of-00001.safetensors"}}'
    (root / "model.safetensors.index.json").write_text(idx)
    expect(root, "config.json: duplicate key 'num_local_experts' in config.json",
           "model.safetensors.index.json: duplicate key 'a' in model.safetensors.index.json")


def test_duplicate_across_shards(tmp_path: Path) -> None:
    root = make_ckpt(tmp_path / "c", {"a": entry("F32", [1], 0, 4)}, bytes(4))
    write_raw(root / "model-2.safetensors", {"a": entry("F32", [1], 0, 4)}, bytes(4))
    idx = {"weight_map": {"a": "model-00001-of-00001.safetensors", "z": "model-2.safetensors"}}
    (root / "model.safetensors.index.json").write_text(json.dumps(idx))
    expect(root, "tensor 'a' appears in both")


def test_unknown_dtype(tmp_path: Path) -> None:
    root = make_ckpt(tmp_path / "c", {"a": entry("F12", [1], 0, 4)}, bytes(4))
    expect(root, "tensor 'a' has unknown dtype 'F12'", "F8_E8M0")


def test_header_length_larger_than_file(tmp_path: Path) -> None:
    root = make_ckpt(tmp_path / "c", {"a": entry("F32", [1], 0, 4)}, bytes(4), length=10_000)
    expect(root, "header length 10000 is larger than the file allows")


def test_index_entry_outside_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "outside.safetensors").write_bytes(b"")
    root = make_ckpt(tmp_path / "c", {"a": entry("F32", [1], 0, 4)}, bytes(4),
                     index={"weight_map": {"a": "../outside.safetensors"}})
    expect(root, "'../outside.safetensors' names a path outside the checkpoint directory")


def test_index_lists_tensor_missing_from_header(tmp_path: Path) -> None:
    name = "model-00001-of-00001.safetensors"
    root = make_ckpt(tmp_path / "c", {"a": entry("F32", [1], 0, 4)}, bytes(4), index={"weight_map": {"a": name, "ghost": name}})
    expect(root, "index lists tensor 'ghost' but the shard's header lacks it")


def test_missing_config(tmp_path: Path) -> None:
    root = make_ckpt(tmp_path / "c", {"a": entry("F32", [1], 0, 4)}, bytes(4))
    (root / "config.json").unlink()
    expect(root, "no config.json")


def test_hf_cache_snapshot_symlinks_are_followed(tmp_path: Path, tiny) -> None:
    """A Hugging Face cache snapshot: files are symlinks into ../../blobs."""
    src = tiny("mixtral")
    repo = tmp_path / "models--x--y"
    blobs, snap = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        os.symlink(Path("../../blobs") / f"blob{i}", snap / f.name)
    ckpt = open_checkpoint(snap)
    ref = open_checkpoint(src)
    assert ckpt.tensors.keys() == ref.tensors.keys()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(ckpt.read(name), ref.read(name))


def test_header_only_checkpoint_plans_but_cannot_read(tmp_path: Path, tiny) -> None:
    src = open_checkpoint(tiny("deepseek-v4"))
    root = tmp_path / "headers"
    root.mkdir()
    shutil.copy(src.root / "config.json", root)
    shutil.copy(src.root / "model.safetensors.index.json", root)
    for shard in src.files.values():
        raw = shard.path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        (root / (shard.name + ".json")).write_bytes(raw[8 : 8 + n])
    ckpt = open_checkpoint(root)
    assert ckpt.header_only and ckpt.tensors.keys() == src.tensors.keys()
    with pytest.raises(SourceError, match="header-only shard"):
        ckpt.read("embed.weight")
    result = runner.invoke(app, ["plan", str(root), "--tp", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["family"] == "deepseek-v4"


def test_slice_bytes_matches_numpy(tmp_path: Path) -> None:
    from shardsmith.checkpoint import slice_bytes

    a = np.arange(2 * 3 * 4, dtype=np.int16).reshape(2, 3, 4)
    raw = np.frombuffer(a.tobytes(), dtype=np.uint8)
    got = slice_bytes(raw, "I16", (2, 3, 4), 1, 1, 2)
    assert np.array_equal(np.frombuffer(np.ascontiguousarray(got).tobytes(), dtype=np.int16).reshape(2, 2, 4), a[:, 1:3])


def test_a_pack_given_as_a_checkpoint_is_named_as_such(tmp_path: Path) -> None:
    (tmp_path / "pack.yaml").write_text("format: shardsmith-pack\n")
    expect(tmp_path, "neither model.safetensors.index.json nor model.safetensors found",
           "a shardsmith pack, not a Hugging Face checkpoint")
