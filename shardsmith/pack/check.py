"""The one check of a pack's files and rank manifests, shared by ``verify``, ``export`` and the loader.

Everything here runs before a byte of weight data is read (only manifests and safetensors headers
are opened), and every path it hands back is safe to open:

- each path a manifest names is a plain relative name inside the pack: not empty, not absolute,
  no ``..``, ``.`` or hidden part, no backslash or NUL (a rank file: one name, no ``/``);
- every file and directory on the way, from the pack root down, is what it claims, found with
  ``lstat``: no symbolic link anywhere under the pack root (rank directories, manifests,
  ``pack.yaml``, weight and copied files), weight and copied files regular files;
- a rank's ``manifest.yaml`` parses into a :class:`~.records.RankManifest`, has its own hash,
  rank, world size and ``pack_id`` right and the hash ``pack.yaml`` records; it lists exactly the
  tensors and bank arrays the plan gives the rank (dtype, shape, bytes); each weight file has the
  size the manifest records and a header that agrees with it (entries, offsets, alignment, the
  ``rank``/``world_size``/``kind``/``layer`` stamps).

Hashing the bytes is left to the caller (:class:`HashJob`): ``verify`` hashes on a thread pool,
the loader while it reads. Problems are strings naming the file, field or tensor, expected and found.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from shardsmith.errors import IntegrityError, ManifestError, PlanError
from shardsmith.pack.banks import expected_entries
from shardsmith.pack.format import (BANK_ALIGN, DATA_START_ALIGN, DENSE_ALIGN, FORMAT, FORMAT_VERSION, PADDING_PREFIX,
                                    RANK_MANIFEST, check_identity, load_yaml, rank_dir, read_header)
from shardsmith.pack.records import FileRecord, PackManifest, RankManifest, TensorRecord, parse_rank_manifest, record_problems
from shardsmith.plans.resolve import ResolvedPlan


@dataclass(frozen=True, slots=True)
class HashJob:
    """One file whose bytes are still to be hashed: ``where`` (pack-relative, for messages), the
    checked ``path``, its recorded ``bytes`` and ``xxh3_128``, and its ``tensors`` (empty for copied files)."""

    where: str
    path: Path
    bytes: int
    xxh3_128: str
    tensors: tuple[TensorRecord, ...] = ()


@dataclass(slots=True)
class RankCheck:
    """What :func:`check_rank` found for one rank.

    Attributes:
        manifest: the parsed rank manifest (``None`` when missing or unparsable).
        problems: every problem found; jobs: the rank's weight files to hash (only those whose
        path, type and size are right); expected: pack-relative paths the rank may hold.
        opaque: the manifest could not be parsed, so which files belong in the rank is unknown.
    """

    manifest: RankManifest | None = None
    problems: list[str] = field(default_factory=list)
    jobs: list[HashJob] = field(default_factory=list)
    expected: set[str] = field(default_factory=set)
    opaque: bool = False


def path_problem(rel: object, *, plain_name: bool = False) -> str | None:
    """Why manifest path ``rel`` is not a safe relative path inside the pack, or ``None``.

    Args:
        plain_name: the path must be one name without ``/`` (rank weight files).
    """
    if not isinstance(rel, str) or not rel:
        return "is empty"
    if "\x00" in rel or "\\" in rel:
        return "holds a NUL or backslash"
    if rel.startswith("/"):
        return "is absolute"
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "is not a plain relative path (empty, '.' or '..' part)"
    if any(p.startswith(".") for p in parts):
        return "names a hidden file"
    if any(len(p.encode()) > 255 for p in parts) or len(rel) > 1024:
        return "is too long"
    if plain_name and len(parts) > 1:
        return "is not a plain file name"
    return None


def lstat_inside(root: Path, rel: str, *, want_dir: bool = False) -> tuple[os.stat_result | None, str | None]:
    """``lstat`` of ``root/rel``, refusing a symbolic link at any level below ``root``.

    Returns:
        ``(stat, None)`` for a regular file (a directory with ``want_dir``), else ``(None, why)``
        with ``why`` one of ``missing``, ``... is a symbolic link ...``, ``not a regular file``.
    """
    cur = root
    parts = PurePosixPath(rel).parts
    for i, part in enumerate(parts):
        cur = cur / part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return None, "missing"
        except OSError as e:
            return None, f"cannot stat: {e.strerror}"
        if stat.S_ISLNK(st.st_mode):
            sub = "/".join(parts[: i + 1])
            return None, (f"is a symbolic link (to {os.readlink(cur)!r:.80}); a pack holds no links" if sub == rel
                          else f"{sub} is a symbolic link; a pack holds no links")
        last = i == len(parts) - 1
        if not last and not stat.S_ISDIR(st.st_mode):
            return None, f"{'/'.join(parts[: i + 1])} is not a directory"
        if last:
            if want_dir and not stat.S_ISDIR(st.st_mode):
                return None, "not a directory"
            if not want_dir and not stat.S_ISREG(st.st_mode):
                return None, "not a regular file"
            return st, None
    return None, "is empty"


def checked_file(root: Path, rel: str, where: str, size: int, problems: list[str]) -> Path | None:
    """``root/rel`` when it is a regular file inside the pack of ``size`` bytes; else a problem is added."""
    st, why = lstat_inside(root, rel)
    if st is None:
        problems.append(f"{where}: {why}")
        return None
    if st.st_size != size:
        problems.append(f"{where}: size expected {size} bytes, found {st.st_size}" + (" (truncated)" if st.st_size < size else ""))
        return None
    return root / rel


def header_problems(path: Path, where: str, rec: FileRecord, rank: int, world: int) -> list[str]:
    """Disagreements between weight file ``path``'s safetensors header and its manifest record."""
    try:
        header, start = read_header(path)
    except (IntegrityError, OSError) as e:
        return [f"{where}: {e}"]
    out = []
    meta = header.get("__metadata__") if isinstance(header.get("__metadata__"), dict) else {}
    want = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "rank": str(rank), "world_size": str(world),
            "kind": rec.kind}
    if rec.kind == "bank":
        want["layer"] = rec.layer
    out += [f"{where}: header metadata {k} expected {v!r}, found {meta.get(k)!r}" for k, v in want.items() if meta.get(k) != v]
    if start % DATA_START_ALIGN:
        out.append(f"{where}: data starts at byte {start}, expected a multiple of {DATA_START_ALIGN}")
    align = BANK_ALIGN if rec.kind == "bank" else DENSE_ALIGN
    listed = {t.name: t for t in rec.tensors}
    for name, e in header.items():
        if name == "__metadata__" or name.startswith(PADDING_PREFIX):
            continue
        t = listed.pop(name, None)
        if t is None:
            out.append(f"{where}: tensor {name!r} in the header is not in the manifest")
            continue
        offs = e.get("data_offsets") if isinstance(e, dict) else None
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(x, int) for x in offs)):
            out.append(f"{where}: tensor {name!r} header data_offsets {offs!r:.60} is not [begin, end]")
            continue
        b, z = offs
        found = (e.get("dtype"), e.get("shape"), start + b, z - b)
        expect = (t.dtype, list(t.shape), t.offset, t.bytes)
        if found != expect:
            out.append(f"{where}: tensor {name!r} header (dtype, shape, offset, bytes) expected {expect}, found {found}")
        if (start + b) % align:
            out.append(f"{where}: tensor {name!r} at byte {start + b}, not {align}-byte aligned")
    out += [f"{where}: tensor {n!r} in the manifest is missing from the header" for n in listed]
    return out


def _plan_problems(where: str, m: RankManifest, plan: ResolvedPlan, rank: int) -> list[str]:
    try:
        dense, banks = expected_entries(plan, rank)
    except PlanError as e:
        return [f"plan.json: {e}"]
    want = {("dense", e.name): (e.dtype, list(e.shape), e.nbytes) for e in dense.values()}
    want |= {(f"bank {layer}", e.name): (e.dtype, list(e.shape), e.nbytes) for layer, es in banks.items() for e in es}
    have: dict = {}
    out = []
    for rec in m.files:
        for t in rec.tensors:
            key = ("dense" if rec.kind == "dense" else f"bank {rec.layer}", t.name)
            if key in have:
                out.append(f"{where}: {key[0]} tensor {key[1]!r} listed twice")
            have[key] = (t.dtype, list(t.shape), t.bytes)
    for key in sorted(want.keys() | have.keys()):
        if want.get(key) != have.get(key):
            out.append(f"{where}: {key[0]} tensor {key[1]!r} (dtype, shape, bytes) expected {want.get(key)} "
                       f"from the plan, found {have.get(key)}")
    return out


def check_rank(root: Path, pack: PackManifest, plan: ResolvedPlan | None, rank: int) -> RankCheck:
    """Check rank ``rank`` of the pack at ``root`` without reading weight data (see the module doc).

    Args:
        pack: the parsed ``pack.yaml``; plan: the checked plan (``None`` skips the tensor list check).
    """
    out = RankCheck()
    world, d = pack.world_size, rank_dir(rank, pack.world_size)
    _, why = lstat_inside(root, d, want_dir=True)
    if why == "missing":
        out.problems.append(f"{d}: missing (a pack of world_size={world} needs every rank 0..{world - 1})")
        return out
    if why is not None:
        out.problems.append(f"{d}: {why}")
        return out
    where = f"{d}/{RANK_MANIFEST}"
    out.expected.add(where)
    st, why = lstat_inside(root, where)
    if st is None:
        out.problems.append(f"{where}: {why}")
        return out
    try:
        raw = load_yaml(root / where)
        out.problems += check_identity(raw, where)
        m = parse_rank_manifest(raw, where)
    except ManifestError as e:
        out.problems.append(str(e).replace(str(root / where), where))
        out.opaque = True
        return out
    out.manifest = m
    for k, have, want in (("rank", m.rank, rank), ("world_size", m.world_size, world), ("pack_id", m.pack_id, pack.pack_id)):
        if have != want:
            out.problems.append(f"{where}: {k} expected {want!r}, found {have!r}")
    listed = pack.ranks[rank].manifest_xxh3_128
    if listed is None:
        out.problems.append(f"{where}: pack.yaml records no manifest hash for rank {rank} (rank not written by this split)")
    elif listed != m.manifest_xxh3_128:
        out.problems.append(f"{where}: hash expected {listed} (pack.yaml), found {m.manifest_xxh3_128}")
    if plan is not None:
        out.problems += _plan_problems(where, m, plan, rank)
    seen: set[str] = set()
    for i, rec in enumerate(m.files):
        if bad := record_problems(rec, where, f"files[{i}]"):
            out.problems += bad
            continue
        if (why := path_problem(rec.path, plain_name=True)) is not None:
            out.problems.append(f"{where}: field files[{i}].path {rec.path!r:.80} {why}")
            continue
        rel = f"{d}/{rec.path}"
        if rec.path == RANK_MANIFEST or rel in seen:
            out.problems.append(f"{where}: field files[{i}].path {rec.path!r} names the manifest or a file listed before")
            continue
        seen.add(rel)
        out.expected.add(rel)
        path = checked_file(root, rel, rel, rec.bytes, out.problems)
        if path is None:
            continue
        out.problems += header_problems(path, rel, rec, rank, world)
        out.jobs.append(HashJob(rel, path, rec.bytes, rec.xxh3_128, rec.tensors))
    return out


def copied_file_jobs(root: Path, pack: PackManifest, problems: list[str], expected: set[str]) -> list[HashJob]:
    """The copied files ``pack.yaml`` lists, as hash jobs (each path checked; problems added)."""
    from shardsmith.pack.format import PACK_MANIFEST, PLAN_FILE

    jobs = []
    for i, c in enumerate(pack.copied_files):
        if (why := path_problem(c.path)) is not None:
            problems.append(f"{PACK_MANIFEST}: field copied_files[{i}].path {c.path!r:.80} {why}")
            continue
        top = c.path.split("/")[0]
        if c.path in expected or c.path in (PACK_MANIFEST, PLAN_FILE) or top.startswith("rank-"):
            problems.append(f"{PACK_MANIFEST}: field copied_files[{i}].path {c.path!r} names a file of the pack itself")
            continue
        expected.add(c.path)
        st, why = lstat_inside(root, c.path)
        if st is None:
            problems.append(f"{c.path}: {why} (copied file)")
        elif st.st_size != c.bytes:
            problems.append(f"{c.path}: size expected {c.bytes} bytes, found {st.st_size} (copied file)")
        else:
            jobs.append(HashJob(c.path, root / c.path, c.bytes, c.xxh3_128))
    return jobs
