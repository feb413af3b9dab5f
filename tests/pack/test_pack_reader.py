"""The pack reader the runtime uses: zero-copy mmap views equal to the plan's shards, and refusals."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml

from shardsmith.checkpoint import open_checkpoint
from shardsmith.errors import IntegrityError, ManifestError, RuntimeLoadError
from shardsmith.pack.reader import open_pack, open_rank
from shardsmith.pack.banks import bank_specs
from shardsmith.writer.slicing import rank_tensor
from shardsmith.writer.split import split_checkpoint


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype != torch.uint8 else t


def _mapping_of(ptr: int) -> str | None:
    """Path of the file mapped at address ``ptr`` in this process, else None."""
    for line in open("/proc/self/maps"):
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= ptr < hi:
            return fields[5] if len(fields) > 5 else None
    return None


@pytest.mark.parametrize("name,tp", [("deepseek-v4", 2), ("mixtral", 4), ("deepseek-v3", 4)])
def test_views_equal_rank_tensor(tiny, tmp_path: Path, name: str, tp: int) -> None:
    src, out = tiny(name), tmp_path / "pack"
    split_checkpoint(src, out, world_size=tp)
    ckpt = open_checkpoint(src)
    for rank in range(tp):
        rp = open_rank(out, rank, tp, verify_hashes=True)
        assert (rp.rank, rp.world_size, rp.root) == (rank, tp, out) and rp.config == ckpt.config
        dense = rp.dense()
        assert set(dense) == {n for n, t in rp.plan.tensors.items() if t.bank is None}
        for n, t in dense.items():
            ref = rank_tensor(ckpt, rp.plan.tensors[n], rank)
            assert t.dtype == ref.dtype and t.shape == ref.shape, n
            assert torch.equal(_bytes(t), _bytes(ref)), n
        banks = rp.banks()
        specs = bank_specs(rp.plan, rank)
        assert set(banks) == set(specs)
        for layer, arrays in banks.items():
            for spec in specs[layer]:
                arr = arrays[spec.name]
                assert tuple(arr.shape[:1]) == spec.shape[:1]
                flat = _bytes(arr).reshape(-1)
                for (e, seg), src_name in spec.members.items():
                    ref = _bytes(rank_tensor(ckpt, rp.plan.tensors[src_name], rank)).reshape(-1)
                    off = spec.slot_offset(e, seg)
                    assert torch.equal(flat[off:off + spec.slot_nbytes], ref), src_name
            gu, down = arrays["gate_up"], arrays["down"]
            i_r = gu.shape[1] // 2
            w1 = next(n for (e, s), n in next(s for s in specs[layer] if s.name == "gate_up").members.items() if (e, s) == (1, 0))
            assert torch.equal(_bytes(gu[1, :i_r]), _bytes(rank_tensor(ckpt, rp.plan.tensors[w1], rank)))
            assert down.shape[0] == gu.shape[0]


def test_banks_are_mmap_views_on_4096_boundaries(tiny, tmp_path: Path) -> None:
    out = tmp_path / "pack"
    split_checkpoint(tiny("deepseek-v4"), out, world_size=2)
    rp = open_rank(out, 1, 2)
    m = yaml.safe_load((out / "rank-1-of-2" / "manifest.yaml").read_text())
    for layer, arrays in rp.banks().items():
        rec = next(f for f in m["files"] if f.get("layer") == layer)
        path = str(out / "rank-1-of-2" / rec["path"])
        base = None
        for t in rec["tensors"]:
            arr = arrays[t["name"]]
            assert _mapping_of(arr.data_ptr()) == path  # a view of the file mapping, not a copy
            storage_ptr = arr.untyped_storage().data_ptr()
            assert base in (None, storage_ptr)
            base = storage_ptr
            assert arr.data_ptr() - storage_ptr == t["offset"] and t["offset"] % 4096 == 0
    w = rp.dense()["layers.0.attn.wq_b.weight"]
    assert _mapping_of(w.data_ptr()) is not None and w.shape == (rp.plan.tensors["layers.0.attn.wq_b.weight"].local_shape(1))


def test_refusals(tiny, tmp_path: Path) -> None:
    out = tmp_path / "pack"
    split_checkpoint(tiny("qwen3-moe"), out, world_size=2)
    assert open_pack(out).world_size == 2
    with pytest.raises(RuntimeLoadError, match="world_size=2, runtime has world_size=4"):
        open_rank(out, 0, 4)
    with pytest.raises(RuntimeLoadError, match="outside"):
        open_rank(out, 2, 2)
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    f = next((bad / "rank-0-of-2").glob("experts-*.safetensors"))
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    open_rank(bad, 0, 2)  # sizes and headers fine
    with pytest.raises(IntegrityError, match="xxh3_128 expected"):
        open_rank(bad, 0, 2, verify_hashes=True)
    f.write_bytes(bytes(data[:-10]))
    with pytest.raises(IntegrityError, match="size expected"):
        open_rank(bad, 0, 2)
    p = bad / "rank-1-of-2" / "manifest.yaml"
    p.write_text(p.read_text().replace("world_size: 2", "world_size: 3"))
    with pytest.raises(ManifestError, match="own hash"):
        open_rank(bad, 1, 2)
    (bad / "pack.yaml").unlink()
    with pytest.raises(ManifestError, match="missing"):
        open_rank(bad, 1, 2)
