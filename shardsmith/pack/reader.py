"""Read a pack written by ``shardsmith split``: the pack manifest, the plan, one rank's tensors.

The runtime calls :func:`open_rank` and gets memory-mapped, zero-copy tensors: every weight file is
mapped once (``MAP_PRIVATE``, read-only use; pages load on first touch) and each tensor or bank
array is a view into that mapping with its rank-local shape. Format: ``manifests/README.md``.

Example:
    >>> from shardsmith.pack.reader import open_rank
    >>> rp = open_rank("packs/v4-tp4", rank=1, world_size=4)  # doctest: +SKIP
    >>> rp.dense()["layers.0.attn.wq_b.weight"].shape  # doctest: +SKIP
    torch.Size([8192, 1024])
    >>> rp.banks()["layers.3"]["gate_up"].shape  # [E, 2*I_r, H]  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from shardsmith.dtypes import DTYPES
from shardsmith.errors import IntegrityError, ManifestError, RuntimeLoadError, format_problems
from shardsmith.plans.resolve import ResolvedPlan
from shardsmith.plans.serialize import plan_from_dict
from shardsmith.pack.format import (BANK_ALIGN, DENSE_ALIGN, PACK_MANIFEST, PLAN_FILE, RANK_MANIFEST, check_identity,
                              hash_file, load_yaml, rank_dir)
from shardsmith.writer.stwriter import read_header

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class Pack:
    """A pack's manifest and plan.

    Attributes:
        root: the pack directory; doc: ``pack.yaml`` as parsed; world_size: ranks;
        pack_id: the pack's identity; plan: the resolved plan rebuilt from ``plan.json``.
    """

    root: Path
    doc: dict
    world_size: int
    pack_id: str
    plan: ResolvedPlan


def open_pack(out_dir: str | os.PathLike) -> Pack:
    """Open the pack at ``out_dir``: ``pack.yaml`` (format, version, own hash) and ``plan.json``.

    Raises:
        ManifestError: ``pack.yaml`` missing, unparsable, of another format version or edited.
        IntegrityError: ``plan.json`` missing or not the bytes ``pack.yaml`` records.
    """
    root = Path(out_dir)
    doc = load_yaml(root / PACK_MANIFEST)
    problems = check_identity(doc, f"{root / PACK_MANIFEST}")
    if problems:
        raise ManifestError(format_problems(f"{root}: bad pack manifest", problems))
    rec = doc.get("plan") or {}
    path = root / PLAN_FILE
    try:
        data = path.read_bytes()
    except OSError as e:
        raise IntegrityError(f"{path}: cannot read: {e}") from None
    import xxhash

    found = xxhash.xxh3_128(data).hexdigest()
    if len(data) != rec.get("bytes") or found != rec.get("xxh3_128"):
        raise IntegrityError(f"{path}: expected {rec.get('bytes')} bytes xxh3_128 {rec.get('xxh3_128')}, "
                             f"found {len(data)} bytes xxh3_128 {found}")
    try:
        plan = plan_from_dict(json.loads(data))
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: not valid JSON: {e}") from None
    if plan.world_size != doc.get("world_size"):
        raise ManifestError(f"{path}: world_size {plan.world_size} but pack.yaml says {doc.get('world_size')}")
    return Pack(root, doc, int(doc["world_size"]), str(doc.get("pack_id")), plan)


@dataclass(slots=True)
class RankPack:
    """One rank's part of a pack, checked and ready to map.

    Attributes:
        rank, world_size: this rank and the pack's world size.
        root: the pack directory (``config.json``, tokenizer and chat template live there).
        config: parsed ``config.json`` (empty if the pack carries none).
        plan: the resolved plan; manifest: the rank's ``manifest.yaml``; dir: the rank directory.
    """

    rank: int
    world_size: int
    root: Path
    config: dict
    plan: ResolvedPlan
    manifest: dict
    dir: Path
    _maps: dict = field(default_factory=dict, repr=False)

    def _base(self, rec: dict) -> "torch.Tensor":
        import torch

        base = self._maps.get(rec["path"])
        if base is None:
            storage = torch.UntypedStorage.from_file(str(self.dir / rec["path"]), shared=False, nbytes=rec["bytes"])
            base = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (rec["bytes"],), (1,))
            self._maps[rec["path"]] = base
        return base

    def _view(self, rec: dict, t: dict) -> "torch.Tensor":
        d = DTYPES[t["dtype"]]
        raw = self._base(rec)[t["offset"]: t["offset"] + t["bytes"]]
        shape = tuple(t["shape"])
        tdt = d.torch_dtype
        if tdt is None:  # F4: packed bytes, last dim in bytes
            return raw.view(*shape[:-1], shape[-1] * d.bits // 8) if shape else raw
        return raw.view(tdt).view(shape)

    def dense(self) -> dict[str, "torch.Tensor"]:
        """Every dense tensor: source name -> zero-copy view, rank-local shape (F4 as ``uint8``)."""
        return {t["name"]: self._view(rec, t) for rec in self.manifest["files"] if rec["kind"] == "dense"
                for t in rec["tensors"]}

    def banks(self) -> dict[str, dict[str, "torch.Tensor"]]:
        """Expert banks: layer key -> array name -> zero-copy view (``gate_up [E, 2*I_r, H]``, ...)."""
        return {rec["layer"]: {t["name"]: self._view(rec, t) for t in rec["tensors"]}
                for rec in self.manifest["files"] if rec["kind"] == "bank"}


def _check_files(rp: RankPack, verify_hashes: bool) -> list[str]:
    problems = []
    d = rank_dir(rp.rank, rp.world_size)
    for rec in rp.manifest.get("files", []):
        path = rp.dir / rec["path"]
        where = f"{d}/{rec['path']}"
        try:
            size = path.stat().st_size
        except OSError:
            problems.append(f"{where}: missing")
            continue
        if size != rec["bytes"]:
            problems.append(f"{where}: size expected {rec['bytes']} bytes, found {size}")
            continue
        try:
            header, _ = read_header(path)
        except IntegrityError as e:
            problems.append(str(e))
            continue
        meta = header.get("__metadata__") or {}
        for k, want in (("rank", str(rp.rank)), ("world_size", str(rp.world_size)), ("kind", rec["kind"])):
            if meta.get(k) != want:
                problems.append(f"{where}: header metadata {k} expected {want!r}, found {meta.get(k)!r}")
        align = BANK_ALIGN if rec["kind"] == "bank" else DENSE_ALIGN
        for t in rec["tensors"]:
            if t["offset"] % align:
                problems.append(f"{where}: tensor {t['name']!r} offset {t['offset']} not {align}-byte aligned")
        if verify_hashes:
            _, found = hash_file(path)
            if found != rec["xxh3_128"]:
                problems.append(f"{where}: xxh3_128 expected {rec['xxh3_128']}, found {found}")
    return problems


def open_rank(out_dir: str | os.PathLike, rank: int, world_size: int, *, verify_hashes: bool = False) -> RankPack:
    """Open rank ``rank`` of the pack at ``out_dir`` for a runtime of ``world_size`` ranks.

    Checks, before returning: ``pack.yaml`` and ``plan.json`` (:func:`open_pack`); the world size;
    the rank manifest's format, own hash, rank, world size and ``pack_id``, and its hash in
    ``pack.yaml``; that it lists exactly the tensors and bank arrays the plan gives this rank with
    their dtypes and shapes; every file's size, header metadata stamps and alignment; with
    ``verify_hashes`` every file's XXH3-128 too (reads every byte).

    Raises:
        RuntimeLoadError: the pack's world size or rank does not match, or the rank is absent.
        ManifestError: a manifest is missing, unparsable, of another version or edited.
        IntegrityError: listing every file, tensor and expected-vs-found value that differs.
    """
    from shardsmith.writer.layout import expected_entries

    pack = open_pack(out_dir)
    if pack.world_size != world_size:
        raise RuntimeLoadError(f"{pack.root}: pack is for world_size={pack.world_size}, runtime has world_size={world_size}")
    if not 0 <= rank < world_size:
        raise RuntimeLoadError(f"rank {rank} outside [0, {world_size})")
    d = pack.root / rank_dir(rank, world_size)
    if not d.is_dir():
        raise RuntimeLoadError(f"{d}: missing (this pack holds ranks {pack.doc.get('ranks_written')})")
    manifest = load_yaml(d / RANK_MANIFEST)
    problems = check_identity(manifest, f"{d.name}/{RANK_MANIFEST}")
    if problems:
        raise ManifestError(format_problems(f"{d}: bad rank manifest", problems))
    for k, want in (("rank", rank), ("world_size", world_size), ("pack_id", pack.pack_id)):
        if manifest.get(k) != want:
            problems.append(f"{d.name}/{RANK_MANIFEST}: {k} expected {want!r}, found {manifest.get(k)!r}")
    listed = (pack.doc.get("ranks") or [{}] * world_size)[rank].get("manifest_xxh3_128")
    if listed is not None and listed != manifest.get("manifest_xxh3_128"):
        problems.append(f"{d.name}/{RANK_MANIFEST}: pack.yaml records hash {listed}, found {manifest.get('manifest_xxh3_128')}")
    dense, banks = expected_entries(pack.plan, rank)
    want = {("dense", e.name): (e.dtype, list(e.shape)) for e in dense.values()}
    want |= {(layer, e.name): (e.dtype, list(e.shape)) for layer, es in banks.items() for e in es}
    have = {(rec.get("layer") or "dense", t["name"]): (t["dtype"], list(t["shape"]))
            for rec in manifest.get("files", []) for t in rec.get("tensors", [])}
    for key in sorted(want.keys() | have.keys()):
        if want.get(key) != have.get(key):
            problems.append(f"{d.name}/{RANK_MANIFEST}: {key[0]} tensor {key[1]!r} expected {want.get(key)}, found {have.get(key)}")
    cfg_path = pack.root / "config.json"
    config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    rp = RankPack(rank, world_size, pack.root, config, pack.plan, manifest, d)
    problems += _check_files(rp, verify_hashes)
    if problems:
        raise IntegrityError(format_problems(f"{d}: rank pack does not match its manifest", problems), problems)
    return rp
