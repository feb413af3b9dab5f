"""Write a pack's documents: ``plan.json``, the copied files, each ``manifest.yaml``, ``pack.yaml``.

Called by :func:`~shardsmith.writer.split.split_checkpoint` once every weight file is written and
hashed; ``pack.yaml`` goes last, so a directory without it is never a finished pack. Schema:
``manifests/README.md``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import xxhash

from .. import __version__
from ..checkpoint import Checkpoint
from ..plans.resolve import ResolvedPlan
from ..plans.serialize import plan_to_dict
from .journal import Journal
from .layout import PackLayout
from shardsmith.pack.format import (FORMAT, FORMAT_VERSION, PACK_MANIFEST, PLAN_FILE, RANK_MANIFEST, dump_yaml, files_to_copy,
                                    pack_id_of, rank_dir, stamp)


def plan_json(plan: ResolvedPlan) -> bytes:
    """``plan.json``'s bytes: :func:`plan_to_dict` as compact JSON."""
    return json.dumps(plan_to_dict(plan), separators=(",", ":")).encode()


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _copy_hashed(src: Path, dst: Path) -> tuple[int, str]:
    dst.parent.mkdir(parents=True, exist_ok=True)
    h, n = xxhash.xxh3_128(), 0
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        while chunk := fi.read(8 << 20):
            h.update(chunk)
            fo.write(chunk)
            n += len(chunk)
        fo.flush()
        os.fsync(fo.fileno())
    return n, h.hexdigest()


def rank_manifest(layout: PackLayout, rank: int, pack_id: str, journal: Journal) -> dict:
    """Rank ``rank``'s ``manifest.yaml`` document (self-hash stamped)."""
    d = rank_dir(rank, layout.world_size)
    files = []
    for path, pf in layout.files.items():
        if pf.rank != rank:
            continue
        dig = journal.files[path]
        rec = {"path": path[len(d) + 1:], "kind": pf.kind}
        if pf.layer is not None:
            rec["layer"] = pf.layer
        rec.update({"bytes": dig.size, "xxh3_128": dig.xxh3_128, "tensors": [
            {"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "offset": e.offset, "bytes": e.nbytes,
             "xxh3_128": dig.tensors[e.name]} for e in pf.layout.entries]})
        files.append(rec)
    return stamp({"format": FORMAT, "format_version": FORMAT_VERSION, "rank": rank,
                  "world_size": layout.world_size, "pack_id": pack_id, "files": files})


def finalize_pack(ckpt: Checkpoint, plan: ResolvedPlan, layout: PackLayout, root: Path, plan_bytes: bytes,
                  journal: Journal) -> str:
    """Write ``plan.json``, the copied files, the rank manifests and (last) ``pack.yaml`` into ``root``.

    Returns:
        the pack id.
    """
    _write(root / PLAN_FILE, plan_bytes)
    plan_hash = xxhash.xxh3_128(plan_bytes).hexdigest()
    sources = [{"name": f.name, "bytes": journal.sources[f.name][0], "xxh3_128": journal.sources[f.name][1]}
               for f in ckpt.files.values()]
    pack_id = pack_id_of(plan_hash, [s["xxh3_128"] for s in sources])
    copied = []
    for rel in files_to_copy(ckpt.root):
        n, h = _copy_hashed(ckpt.root / rel, root / rel)
        copied.append({"path": rel, "bytes": n, "xxh3_128": h})
    ranks = []
    for r in range(layout.world_size):
        entry = {"rank": r, "dir": rank_dir(r, layout.world_size), "manifest_xxh3_128": None}
        if r in layout.ranks:
            doc = rank_manifest(layout, r, pack_id, journal)
            _write(root / entry["dir"] / RANK_MANIFEST, dump_yaml(doc).encode())
            entry["manifest_xxh3_128"] = doc["manifest_xxh3_128"]
        ranks.append(entry)
    from ..plans import family_of

    doc = stamp({
        "format": FORMAT, "format_version": FORMAT_VERSION, "world_size": layout.world_size,
        "created_by": f"shardsmith {__version__}",
        "source": {"architecture": family_of(ckpt.config), "family": plan.family, "files": sources},
        "plan": {"file": PLAN_FILE, "bytes": len(plan_bytes), "xxh3_128": plan_hash, "family": plan.family,
                 "align": plan.align, "notes": list(plan.notes)},
        "copied_files": copied,
        "ranks": ranks,
        "ranks_written": list(layout.ranks),
        "pack_id": pack_id,
    })
    _write(root / PACK_MANIFEST, dump_yaml(doc).encode())
    return pack_id
