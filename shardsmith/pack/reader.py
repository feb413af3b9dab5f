"""Read a pack written by ``shardsmith split``: the pack manifest, the plan, one rank's tensors.

The runtime calls :func:`open_rank` and gets memory-mapped, zero-copy tensors: every weight file is
mapped once (``MAP_PRIVATE``, read-only use) and each tensor or bank array is a view into that
mapping with its rank-local shape. Before a byte of weight data is read the rank passes the one
rank check (:func:`shardsmith.pack.check.check_rank`: safe paths, no links, manifests, headers,
sizes); with ``verify`` (the default) each file is hashed (XXH3-128, the manifest's digest) when it
is first mapped, and a file whose bytes differ is refused. Format: ``manifests/README.md``.

Example:
    >>> from shardsmith.pack.reader import open_rank
    >>> rp = open_rank("packs/v4-tp4", rank=1, world_size=4)  # doctest: +SKIP
    >>> rp.dense()["layers.0.attn.wq_b.weight"].shape  # doctest: +SKIP
    torch.Size([8192, 1024])
    >>> rp.banks()["layers.3"]["gate_up"].shape  # [E, 2*I_r, H]  # doctest: +SKIP
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from shardsmith.errors import IntegrityError, ManifestError, RuntimeLoadError, format_problems
from shardsmith.pack.check import check_rank, copied_file_jobs, lstat_inside
from shardsmith.pack.coverage import json_problems, plan_problems
from shardsmith.dtypes import typed_view
from shardsmith.pack.format import PACK_MANIFEST, PLAN_FILE, RANK_MANIFEST, check_identity, hash_file, load_yaml, rank_dir, root_digest
from shardsmith.strict_parse import loads_json
from shardsmith.pack.records import FileRecord, PackManifest, RankManifest, TensorRecord, parse_pack_manifest
from shardsmith.plans.resolve import ResolvedPlan

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class Pack:
    """A pack's manifest and plan.

    Attributes:
        root: the pack directory; doc: ``pack.yaml``, parsed; world_size: ranks;
        pack_id: the pack's identity; plan: the resolved plan rebuilt from ``plan.json``;
        digest: the root digest (XXH3-128 of ``pack.yaml``'s bytes, :func:`~.format.root_digest`).
    """

    root: Path
    doc: PackManifest
    world_size: int
    pack_id: str
    plan: ResolvedPlan
    digest: str


def read_pack_manifest(root: Path, problems: list[str]) -> tuple[PackManifest | None, str | None]:
    """``pack.yaml`` of ``root``, parsed and checked (format, version, own hash, schema); and its root digest.

    Problems are added to ``problems``; the manifest is ``None`` when it cannot be used at all.
    """
    st, why = lstat_inside(root, PACK_MANIFEST)
    if st is None:
        problems.append(f"{PACK_MANIFEST}: {why}" + (" (a split that did not finish leaves no pack.yaml)" if why == "missing" else ""))
        return None, None
    try:
        data = (root / PACK_MANIFEST).read_bytes()
        raw = load_yaml(root / PACK_MANIFEST)
        problems += check_identity(raw, PACK_MANIFEST)
        return parse_pack_manifest(raw, PACK_MANIFEST), root_digest(data)
    except OSError as e:
        problems.append(f"{PACK_MANIFEST}: cannot read: {e.strerror}")
    except ManifestError as e:
        problems.append(str(e).replace(f"{root / PACK_MANIFEST}", PACK_MANIFEST))
    return None, None


def load_plan(root: Path, doc: PackManifest, problems: list[str]) -> ResolvedPlan | None:
    """``plan.json``, checked against ``pack.yaml`` (bytes, XXH3-128, world size) and rebuilt.

    The plan is returned only when every check holds and its values and coverage are sound
    (:func:`~.coverage.plan_problems`), so the arithmetic later run on it cannot fail.
    """
    from shardsmith.plans.serialize import plan_from_dict

    st, why = lstat_inside(root, PLAN_FILE)
    if st is None:
        problems.append(f"{PLAN_FILE}: {why}")
        return None
    data = (root / PLAN_FILE).read_bytes()
    rec = doc.plan
    found = (len(data), xxhash.xxh3_128(data).hexdigest())
    if found != (rec.bytes, rec.xxh3_128):
        problems.append(f"{PLAN_FILE}: (bytes, xxh3_128) expected {(rec.bytes, rec.xxh3_128)}, found {found}")
        return None
    try:
        raw = loads_json(data)
        if bad := json_problems(raw):
            problems += bad
            return None
        plan = plan_from_dict(raw)
        if plan.world_size != doc.world_size:
            problems.append(f"{PLAN_FILE}: world_size expected {doc.world_size} (pack.yaml), found {plan.world_size}")
            return None
        more = plan_problems(plan)
    except (ValueError, ManifestError) as e:
        problems.append(f"{PLAN_FILE}: cannot rebuild the plan: {e}")
        return None
    except (KeyError, TypeError, IndexError, AttributeError, ZeroDivisionError, OverflowError, RecursionError) as e:
        problems.append(f"{PLAN_FILE}: cannot rebuild the plan: malformed ({type(e).__name__}: {e})")
        return None
    problems += more
    return None if more else plan


def open_pack(out_dir: str | os.PathLike, *, expect_digest: str | None = None) -> Pack:
    """Open the pack at ``out_dir``: ``pack.yaml`` (schema, format, version, own hash) and ``plan.json``.

    Args:
        expect_digest: the root digest the pack must have (as ``split`` printed it).

    Raises:
        ManifestError: ``pack.yaml`` missing, unparsable, of another format version, edited, or
            not of ``expect_digest``.
        IntegrityError: ``plan.json`` missing, not the bytes ``pack.yaml`` records, or unsound.
    """
    root = Path(out_dir)
    problems: list[str] = []
    doc, digest = read_pack_manifest(root, problems)
    if doc is None or problems:
        raise ManifestError(format_problems(f"{root}: bad pack manifest", problems))
    if expect_digest is not None and digest != expect_digest.strip().lower():
        raise ManifestError(f"{root / PACK_MANIFEST}: root digest expected {expect_digest}, found {digest} "
                            f"(this is not the pack that digest pins)")
    plan = load_plan(root, doc, problems)
    if plan is None:
        raise IntegrityError(format_problems(f"{root}: bad plan", problems), problems)
    return Pack(root, doc, doc.world_size, doc.pack_id, plan, digest)


@dataclass(slots=True)
class RankPack:
    """One rank's part of a pack, checked and ready to map.

    Attributes:
        rank, world_size: this rank and the pack's world size.
        root: the pack directory (``config.json``, tokenizer and chat template live there).
        config: parsed ``config.json`` (empty if the pack carries none).
        plan: the resolved plan; manifest: the rank's manifest; dir: the rank directory.
        verify: hash each weight file against the manifest when it is first mapped.
    """

    rank: int
    world_size: int
    root: Path
    config: dict
    plan: ResolvedPlan
    manifest: RankManifest
    dir: Path
    verify: bool = True
    _maps: dict = field(default_factory=dict, repr=False)

    def check_file(self, rec: FileRecord, data: memoryview | None = None) -> None:
        """Hash weight file ``rec`` (``data``: its mapped bytes, else one sequential read) and refuse it if they differ.

        Raises:
            IntegrityError: naming the file, the recorded and the found digest.
        """
        if data is None:
            n, found = hash_file(self.dir / rec.path)
        else:
            n, found = len(data), xxhash.xxh3_128(data).hexdigest()
        if (n, found) != (rec.bytes, rec.xxh3_128):
            where = f"{self.dir.name}/{rec.path}"
            what = f"xxh3_128 expected {rec.xxh3_128}, found {found}" + (f" ({n} bytes, expected {rec.bytes})" if n != rec.bytes else "")
            raise IntegrityError(f"{self.root}: {where}: {what}; the file is damaged, refused before use "
                                 f"(shardsmith verify {self.root} --rank {self.rank})", [f"{where}: {what}"])

    def _base(self, rec: FileRecord) -> "torch.Tensor":
        import torch

        base = self._maps.get(rec.path)
        if base is None:
            storage = torch.UntypedStorage.from_file(str(self.dir / rec.path), shared=False, nbytes=rec.bytes)
            base = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (rec.bytes,), (1,))
            if self.verify:  # hash the mapping itself: one pass that also faults in the pages the model reads next
                self.check_file(rec, memoryview(base.numpy()))
            self._maps[rec.path] = base
        return base

    def _view(self, rec: FileRecord, t: TensorRecord) -> "torch.Tensor":
        return typed_view(self._base(rec)[t.offset: t.offset + t.bytes], t.dtype, t.shape)

    def dense(self) -> dict[str, "torch.Tensor"]:
        """Every dense tensor: source name -> zero-copy view, rank-local shape (F4 as ``uint8``).

        Raises:
            IntegrityError: with ``verify``, a dense file whose bytes differ from the manifest.
        """
        return {t.name: self._view(rec, t) for rec in self.manifest.files if rec.kind == "dense" for t in rec.tensors}

    def banks(self) -> dict[str, dict[str, "torch.Tensor"]]:
        """Expert banks: layer key -> array name -> zero-copy view (``gate_up [E, 2*I_r, H]``, ...).

        Raises:
            IntegrityError: with ``verify``, a bank file whose bytes differ from the manifest.
        """
        return {rec.layer: {t.name: self._view(rec, t) for t in rec.tensors}
                for rec in self.manifest.files if rec.kind == "bank"}


def open_rank(out_dir: str | os.PathLike, rank: int, world_size: int, *, verify: bool = True,
              verify_hashes: bool = False, expect_digest: str | None = None) -> RankPack:
    """Open rank ``rank`` of the pack at ``out_dir`` for a runtime of ``world_size`` ranks.

    Checks, before returning and before reading any weight data: ``pack.yaml`` and ``plan.json``
    (:func:`open_pack`, with ``expect_digest``); the world size; the one rank check
    (:func:`~shardsmith.pack.check.check_rank`). With ``verify_hashes`` every weight file is hashed
    now; with ``verify`` (default) each is hashed when first mapped by :meth:`RankPack.dense` /
    :meth:`RankPack.banks`.

    Raises:
        RuntimeLoadError: the pack's world size or rank does not match, or the rank is absent.
        ManifestError: a manifest is missing, unparsable, of another version, edited, or the root
            digest differs from ``expect_digest``.
        IntegrityError: listing every file, tensor and expected-vs-found value that differs.
    """
    pack = open_pack(out_dir, expect_digest=expect_digest)
    if pack.world_size != world_size:
        raise RuntimeLoadError(f"{pack.root}: pack is for world_size={pack.world_size}, runtime has world_size={world_size}")
    if not 0 <= rank < world_size:
        raise RuntimeLoadError(f"rank {rank} outside [0, {world_size})")
    d = pack.root / rank_dir(rank, world_size)
    if not os.path.lexists(d):
        raise RuntimeLoadError(f"{d}: missing (this pack holds ranks {list(pack.doc.ranks_written)})")
    chk = check_rank(pack.root, pack.doc, pack.plan, rank)
    if chk.manifest is None or any(p.startswith(f"{d.name}/{RANK_MANIFEST}: ") for p in chk.problems):
        raise ManifestError(format_problems(f"{d}: bad rank manifest", chk.problems))
    if chk.problems:
        raise IntegrityError(format_problems(f"{d}: rank pack does not match its manifest", chk.problems), chk.problems)
    problems: list[str] = []
    expected: set[str] = set()
    copied = copied_file_jobs(pack.root, pack.doc, problems, expected)
    if problems:
        raise IntegrityError(format_problems(f"{pack.root}: copied files do not match pack.yaml", problems), problems)
    if verify:
        for job in copied:
            if hash_file(job.path) != (job.bytes, job.xxh3_128):
                raise IntegrityError(f"{pack.root}: {job.where}: xxh3_128 differs from pack.yaml's {job.xxh3_128} "
                                     f"(shardsmith verify {pack.root} --rank {rank})")
    config: dict = {}
    if "config.json" in expected:
        try:
            config = loads_json((pack.root / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ManifestError(f"{pack.root / 'config.json'}: cannot parse: {e}") from None
    rp = RankPack(rank, world_size, pack.root, config, pack.plan, chk.manifest, d, verify)
    if verify_hashes:
        for rec in chk.manifest.files:
            rp.check_file(rec)
    return rp
