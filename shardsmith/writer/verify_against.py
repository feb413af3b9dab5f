"""``verify --against CKPT``: compare every shard in a pack with the source, byte for byte.

The source is streamed once, one tensor at a time in (file, offset) order, and hashed as it goes
(each source shard's XXH3-128 is checked against ``pack.yaml``). For each tensor and each rank
checked, the bytes the plan assigns to that rank (:func:`~.split.shard_pieces`, the same
arithmetic as :func:`shardsmith.pack.banks.cut`) are compared with what the pack holds at the shard's place:
its dense entry, or its slot in the layer's expert bank. Together with the coverage check of
:mod:`.coverage` (the ranges tile each axis), this is the source rebuilt from the rank slices:
every source byte is compared wherever the pack holds it, copies (replicated tensors, KV heads)
included. Memory: the tensor being compared plus one rank's shard (``<= 3 x`` the largest tensor).

First :func:`source_mismatch` compares the checkpoint's identity (architecture, tensor names, shard
names and sizes) with what ``pack.yaml`` and the plan record: another model is said to be one in a
few lines instead of hundreds of differing tensors.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import xxhash

from ..checkpoint import Checkpoint
from ..errors import PlanError
from ..plans.resolve import ResolvedPlan
from shardsmith.pack.banks import bank_specs
from shardsmith.pack.format import rank_dir
from shardsmith.pack.records import PackManifest, RankManifest
from .split import shard_pieces


def _locations(plan: ResolvedPlan, manifests: dict[int, RankManifest], world: int) -> dict[tuple[int, str], tuple[str, int, int]]:
    """``(rank, source tensor) -> (pack-relative file, absolute offset, bytes)`` from the manifests."""
    loc: dict[tuple[int, str], tuple[str, int, int]] = {}
    for r, m in manifests.items():
        d = rank_dir(r, world)
        arrays = {}
        for rec in m.files:
            for t in rec.tensors:
                path = f"{d}/{rec.path}"
                if rec.kind == "bank":
                    arrays[(rec.layer, t.name)] = (path, t.offset)
                else:
                    loc[(r, t.name)] = (path, t.offset, t.bytes)
        try:
            specs = bank_specs(plan, r)
        except PlanError:
            continue  # reported by the coverage check
        for layer, ss in specs.items():
            for s in ss:
                if (layer, s.name) in arrays:
                    path, off = arrays[(layer, s.name)]
                    for (e, seg), src in s.members.items():
                        loc[(r, src)] = (path, off + s.slot_offset(e, seg), s.slot_nbytes)
    return loc


def source_mismatch(doc: PackManifest, plan: ResolvedPlan, ckpt: Checkpoint) -> list[str]:
    """How checkpoint ``ckpt`` differs in identity from the source ``pack.yaml`` records.

    Compares the architecture, the shard file names and sizes, and the tensor names with the
    plan's; any difference means ``ckpt`` is another checkpoint, not a damaged copy of the source
    (a damaged copy keeps names and sizes: the byte comparison then finds where it differs).

    Returns:
        one line per difference, empty when the identity matches.
    """
    from ..plans import family_of

    out = []
    try:
        arch = family_of(ckpt.config)
    except PlanError:
        arch = ckpt.architecture
    if doc.architecture and doc.architecture != arch:
        out.append(f"architecture: pack.yaml records {doc.architecture!r}, {ckpt.root} is {arch!r}")
    missing, extra = plan.tensors.keys() - ckpt.tensors.keys(), ckpt.tensors.keys() - plan.tensors.keys()
    if missing or extra:
        out.append(f"tensors: {len(missing)} of the plan's {len(plan.tensors)} are not in {ckpt.root}, "
                   f"which has {len(extra)} the plan lacks")
    recorded = {f.path: f.bytes for f in doc.source_files}
    for name in sorted(recorded.keys() - ckpt.files.keys()):
        out.append(f"source file {name}: recorded in pack.yaml, absent from {ckpt.root}")
    for name in sorted(ckpt.files.keys() - recorded.keys()):
        out.append(f"source file {name}: in {ckpt.root}, not recorded in pack.yaml")
    for name in sorted(recorded.keys() & ckpt.files.keys()):
        if recorded[name] != ckpt.files[name].size:
            out.append(f"source file {name}: pack.yaml records {recorded[name]} bytes, {ckpt.root} has {ckpt.files[name].size}")
    return out


def compare_with_source(root: Path, ckpt: Checkpoint, doc: PackManifest, plan: ResolvedPlan,
                        manifests: dict[int, RankManifest]) -> tuple[list[str], int, int]:
    """Compare the pack at ``root`` (ranks in ``manifests``) with the opened checkpoint ``ckpt``.

    ``manifests`` must hold only ranks that passed :func:`shardsmith.pack.check.check_rank`, so
    every file opened here is a checked regular file inside the pack.

    Returns:
        ``(problems, source tensors compared, bytes read from source and pack)``.
    """
    ckpt_dir = ckpt.root
    problems: list[str] = []
    for name in sorted(plan.tensors.keys() - ckpt.tensors.keys()):
        problems.append(f"plan.json: tensor {name!r} is not in the source {ckpt_dir}")
    for name in sorted(ckpt.tensors.keys() - plan.tensors.keys()):
        problems.append(f"source {ckpt.tensors[name].file}: tensor {name!r} is missing from plan.json")
    recorded = {f.path: f for f in doc.source_files}
    if set(recorded) != set(ckpt.files):
        problems.append(f"pack.yaml: source files {sorted(recorded)} but {ckpt_dir} has {sorted(ckpt.files)}")
    world = plan.world_size
    loc = _locations(plan, manifests, world)
    fds: dict[str, int] = {}
    compared = nread = 0
    try:
        for shard in ckpt.files.values():
            h = xxhash.xxh3_128()
            with open(shard.path, "rb", buffering=0) as fh:
                h.update(fh.read(shard.data_start))
                for info in sorted((i for i in ckpt.tensors.values() if i.file == shard.name), key=lambda i: i.offset):
                    raw = np.empty(info.nbytes, dtype=np.uint8)
                    fh.seek(info.offset)
                    got = fh.readinto(memoryview(raw))
                    h.update(memoryview(raw))
                    nread += info.nbytes
                    tp = plan.tensors.get(info.name)
                    if tp is None or got != info.nbytes:
                        continue
                    if (tp.dtype, tuple(tp.shape)) != (info.dtype, tuple(info.shape)):
                        problems.append(f"plan.json: tensor {info.name!r} is {tp.dtype}{list(tp.shape)}, source "
                                        f"{shard.name} has {info.dtype}{list(info.shape)}")
                        continue
                    compared += 1
                    for r in manifests:
                        where = loc.get((r, info.name))
                        if where is None:
                            problems.append(f"{rank_dir(r, world)}: no shard of source tensor {info.name!r} in the manifest")
                            continue
                        path, off, n = where
                        pieces = shard_pieces(raw, tp, r)
                        want = sum(p.nbytes for p in pieces)
                        if want != n:
                            problems.append(f"{path}: tensor {info.name!r} shard is {n} bytes, expected {want} from the source")
                            continue
                        fd = fds.get(path)
                        if fd is None:
                            fd = fds[path] = os.open(root / path, os.O_RDONLY)
                        have = np.frombuffer(os.pread(fd, n, off), dtype=np.uint8)
                        nread += have.nbytes
                        k = 0
                        for p in pieces:
                            seg = have[k:k + p.nbytes]
                            if seg.nbytes != p.nbytes or not np.array_equal(seg, p):
                                first = k + (int(np.flatnonzero(seg != p[: seg.nbytes])[0]) if seg.nbytes == p.nbytes else seg.nbytes)
                                problems.append(f"{path}: tensor {info.name!r} (rank {r}) differs from source {shard.name} "
                                                f"at shard byte {first}")
                                break
                            k += p.nbytes
            rec = recorded.get(shard.name)
            if rec is not None and (rec.bytes, rec.xxh3_128) != (shard.size, h.hexdigest()):
                problems.append(f"source {shard.name}: (bytes, xxh3_128) expected {(rec.bytes, rec.xxh3_128)} "
                                f"(pack.yaml), found {(shard.size, h.hexdigest())}")
    finally:
        for fd in fds.values():
            os.close(fd)
    return problems, compared, nread
