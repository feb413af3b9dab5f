"""``verify``: prove a pack intact and complete, collecting every problem instead of stopping.

Checks (each problem names the file, the tensor where there is one, and expected vs found):

- ``pack.yaml``: format, version, own hash; ``plan.json``: bytes and XXH3-128 as recorded;
- plan coverage from ``plan.json`` alone (:mod:`.coverage`);
- every rank of the world present (only rank ``rank`` with ``rank=``); each ``manifest.yaml``:
  format, own hash, rank, world size, ``pack_id``, and its hash as ``pack.yaml`` records it;
- each manifest lists exactly the tensors and bank arrays the plan gives its rank, with the plan's
  dtypes and rank-local shapes (:func:`~.layout.expected_entries`);
- each weight file: size, XXH3-128, safetensors header (entries, offsets and alignment as the
  manifest says, metadata stamps ``rank``/``world_size``/``kind``/``layer``); copied files: size
  and hash; no missing and no unexpected files or directories (a ``rank-*-of-M`` directory of
  another world size is named as such);
- ``deep``: each tensor's and bank array's hash too, from the same single read of each file;
- ``against``: every shard compared byte for byte with the source (:mod:`.verify_against`).

Files are hashed on a small thread pool (reads and XXH3 release the GIL), each read once.
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import xxhash

from ..errors import IntegrityError, ManifestError, PlanError, UsageError
from .coverage import plan_problems
from .outdir import rank_of_pack, unfinished_split
from shardsmith.pack.format import (BANK_ALIGN, DENSE_ALIGN, FORMAT, FORMAT_VERSION, PACK_MANIFEST, PLAN_FILE, RANK_MANIFEST,
                       check_identity, load_yaml, rank_dir)
from .stwriter import DATA_START_ALIGN, PADDING_PREFIX, read_header

RANK_DIR = re.compile(r"rank-(\d+)-of-(\d+)")
MISMATCH_LINES = 10  # identity differences listed when --against names another checkpoint


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """The outcome of :func:`verify_pack`.

    Attributes:
        out_dir: the pack; problems: every problem found, sorted (empty when intact);
        ranks: ranks checked; files_checked: weight and copied files hashed;
        bytes_hashed: bytes read and hashed: the pack's files once, plus with ``against`` the
            source and pack bytes read again for the comparison; tensors_compared: source tensors compared
        (``against``); deep, against: the options; seconds: wall time;
        summary: one line to lead the problems with, or "" (the pack holds only some ranks;
        ``against`` is another checkpoint).
    """

    out_dir: str
    problems: tuple[str, ...]
    ranks: tuple[int, ...]
    files_checked: int
    bytes_hashed: int
    tensors_compared: int
    deep: bool
    against: str | None
    seconds: float
    summary: str = ""

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def to_dict(self) -> dict:
        """JSON-ready form (``ok`` included)."""
        return {"ok": self.ok, **asdict(self), "problems": list(self.problems), "ranks": list(self.ranks)}


def hash_ranges(path: Path, ranges: list[tuple[int, int]], *, chunk: int = 8 << 20) -> tuple[int, str, list[str]]:
    """One read of ``path``: ``(bytes, file XXH3-128, XXH3-128 of each [begin, end) range)``.

    ``ranges`` must be sorted and disjoint (a file's tensors in file order).
    """
    fh_all = xxhash.xxh3_128()
    hs = [xxhash.xxh3_128() for _ in ranges]
    idx, pos = 0, 0
    buf = bytearray(chunk)
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while k := fh.readinto(buf):
            data, end = mv[:k], pos + k
            fh_all.update(data)
            while idx < len(ranges):
                b, e = ranges[idx]
                if b >= end and e > b:
                    break
                a, z = max(b, pos), min(e, end)
                if a < z:
                    hs[idx].update(data[a - pos:z - pos])
                if e > end:
                    break
                idx += 1
            pos = end
    return pos, fh_all.hexdigest(), [h.hexdigest() for h in hs]


def _header_problems(path: Path, where: str, rec: dict, rank: int, world: int) -> list[str]:
    try:
        header, start = read_header(path)
    except (IntegrityError, OSError) as e:
        return [f"{where}: {e}"]
    out = []
    meta = header.get("__metadata__") or {}
    want = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "rank": str(rank), "world_size": str(world),
            "kind": rec.get("kind")}
    if rec.get("kind") == "bank":
        want["layer"] = rec.get("layer")
    out += [f"{where}: header metadata {k} expected {v!r}, found {meta.get(k)!r}" for k, v in want.items() if meta.get(k) != v]
    if start % DATA_START_ALIGN:
        out.append(f"{where}: data starts at byte {start}, expected a multiple of {DATA_START_ALIGN}")
    align = BANK_ALIGN if rec.get("kind") == "bank" else DENSE_ALIGN
    listed = {t["name"]: t for t in rec.get("tensors", [])}
    for name, e in header.items():
        if name == "__metadata__" or name.startswith(PADDING_PREFIX):
            continue
        t = listed.pop(name, None)
        if t is None:
            out.append(f"{where}: tensor {name!r} in the header is not in the manifest")
            continue
        b, z = e.get("data_offsets", [0, 0])
        found = (e.get("dtype"), list(e.get("shape", [])), start + b, z - b)
        expect = (t["dtype"], list(t["shape"]), t["offset"], t["bytes"])
        if found != expect:
            out.append(f"{where}: tensor {name!r} header (dtype, shape, offset, bytes) expected {expect}, found {found}")
        if (start + b) % align:
            out.append(f"{where}: tensor {name!r} at byte {start + b}, not {align}-byte aligned")
    out += [f"{where}: tensor {n!r} in the manifest is missing from the header" for n in listed]
    return out


def _load_plan(root: Path, doc: dict, problems: list[str]):
    from ..plans.serialize import plan_from_dict
    import json

    rec = doc.get("plan") or {}
    path = root / PLAN_FILE
    if not path.is_file():
        problems.append(f"{PLAN_FILE}: missing")
        return None
    data = path.read_bytes()
    found = (len(data), xxhash.xxh3_128(data).hexdigest())
    if found != (rec.get("bytes"), rec.get("xxh3_128")):
        problems.append(f"{PLAN_FILE}: (bytes, xxh3_128) expected {(rec.get('bytes'), rec.get('xxh3_128'))}, found {found}")
    try:
        plan = plan_from_dict(json.loads(data))
    except (ValueError, ManifestError) as e:
        problems.append(f"{PLAN_FILE}: cannot rebuild the plan: {e}")
        return None
    if plan.world_size != doc.get("world_size"):
        problems.append(f"{PLAN_FILE}: world_size expected {doc.get('world_size')} (pack.yaml), found {plan.world_size}")
    problems.extend(plan_problems(plan))
    return plan


def _check_rank(root: Path, r: int, world: int, doc: dict, plan, problems: list[str], jobs: list, expected: set) -> dict | None:
    from .layout import expected_entries

    d = rank_dir(r, world)
    if not (root / d).is_dir():
        problems.append(f"{d}: missing (a pack of world_size={world} needs every rank 0..{world - 1})")
        return None
    expected.add(f"{d}/{RANK_MANIFEST}")
    try:
        m = load_yaml(root / d / RANK_MANIFEST)
    except ManifestError as e:
        problems.append(f"{d}/{RANK_MANIFEST}: {e}")
        return None
    where = f"{d}/{RANK_MANIFEST}"
    problems += check_identity(m, where)
    for k, want in (("rank", r), ("world_size", world), ("pack_id", doc.get("pack_id"))):
        if m.get(k) != want:
            problems.append(f"{where}: {k} expected {want!r}, found {m.get(k)!r}")
    ranks = doc.get("ranks") or []
    listed = ranks[r].get("manifest_xxh3_128") if r < len(ranks) and isinstance(ranks[r], dict) else None
    if listed is None:
        problems.append(f"{where}: pack.yaml records no manifest hash for rank {r} (rank not written by this split)")
    elif listed != m.get("manifest_xxh3_128"):
        problems.append(f"{where}: hash expected {listed} (pack.yaml), found {m.get('manifest_xxh3_128')}")
    files = m.get("files") or []
    if plan is not None:
        try:
            dense, banks = expected_entries(plan, r)
        except PlanError as e:
            problems.append(f"{PLAN_FILE}: {e}")
            dense, banks = {}, {}
        want = {("dense", e.name): (e.dtype, list(e.shape), e.nbytes) for e in dense.values()}
        want |= {(f"bank {layer}", e.name): (e.dtype, list(e.shape), e.nbytes) for layer, es in banks.items() for e in es}
        have: dict = {}
        for rec in files:
            for t in rec.get("tensors", []):
                key = ("dense" if rec.get("kind") == "dense" else f"bank {rec.get('layer')}", t.get("name"))
                if key in have:
                    problems.append(f"{where}: {key[0]} tensor {key[1]!r} listed twice")
                have[key] = (t.get("dtype"), list(t.get("shape", [])), t.get("bytes"))
        for key in sorted(want.keys() | have.keys()):
            if want.get(key) != have.get(key):
                problems.append(f"{where}: {key[0]} tensor {key[1]!r} (dtype, shape, bytes) expected {want.get(key)} "
                                f"from the plan, found {have.get(key)}")
    for rec in files:
        rel = str(rec.get("path", ""))
        if "/" in rel or rel.startswith(".") or not rel:
            problems.append(f"{where}: file path {rel!r} is not a plain name")
            continue
        expected.add(f"{d}/{rel}")
        path = root / d / rel
        if not path.is_file():
            problems.append(f"{d}/{rel}: missing")
            continue
        problems += _header_problems(path, f"{d}/{rel}", rec, r, world)
        jobs.append((f"{d}/{rel}", path, rec.get("bytes"), rec.get("xxh3_128"), rec.get("tensors", [])))
    return m


def _unexpected(root: Path, world: int, selected: set[int], expected: set[str]) -> list[str]:
    out = []
    parents = {str(Path(p).parent) for p in expected}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root).as_posix()
        keep = []
        for dn in sorted(dirnames):
            sub = dn if rel == "." else f"{rel}/{dn}"
            m = RANK_DIR.fullmatch(dn) if rel == "." else None
            if m and int(m.group(2)) != world:
                out.append(f"{sub}: unexpected directory (a rank of world_size={m.group(2)}; this pack has world_size={world})")
            elif m and int(m.group(1)) >= world:
                out.append(f"{sub}: unexpected directory (rank {m.group(1)} outside world_size={world})")
            elif m and int(m.group(1)) not in selected:
                continue  # another rank of this pack, not checked (--rank)
            elif any(p == sub or p.startswith(sub + "/") for p in parents):
                keep.append(dn)
            else:
                out.append(f"{sub}/: unexpected directory")
        dirnames[:] = keep
        for fn in filenames:
            sub = fn if rel == "." else f"{rel}/{fn}"
            if sub not in expected:
                out.append(f"{sub}: unexpected file")
    return out


def _check_target(root: Path) -> str | None:
    """Raise :class:`UsageError` when ``root`` is no pack at all; a problem line for an unfinished one."""
    partial = root.with_name(root.name + ".partial")
    if not root.exists():
        if partial.is_dir():
            return f"{root}: no pack here ({partial.name} holds an unfinished split: rerun split with --resume)"
        raise UsageError(f"{root}: no such directory")
    if not root.is_dir():
        raise UsageError(f"{root}: not a directory (verify takes a pack directory written by split)")
    if (root / PACK_MANIFEST).exists():
        return None
    if note := unfinished_split(root):  # OUT.partial itself
        return note
    if where := rank_of_pack(root):
        r, n, pack = where
        raise UsageError(f"{root}: is rank {r} of {n} of the pack {pack}, not a pack itself; verify the pack: "
                         f"`shardsmith verify {pack} --rank {r}`")
    if (root / "config.json").is_file() and any(root.glob("*.safetensors*")):
        raise UsageError(f"{root}: this looks like a checkpoint (config.json + safetensors), not a pack; did you mean "
                         f"`shardsmith split` or `verify PACK --against CKPT`?")
    if not (root / PLAN_FILE).exists() and not any(RANK_DIR.fullmatch(p.name) for p in root.iterdir()):
        raise UsageError(f"{root}: not a pack (no {PACK_MANIFEST}, {PLAN_FILE} or rank-<r>-of-<N> directories)")
    return None  # a pack that lost its pack.yaml: reported below as damage


def _open_against(against: Path):
    """The checkpoint ``--against`` names, opened (headers validated); usage and source errors raised."""
    from ..checkpoint import open_checkpoint

    if not against.is_dir():
        raise UsageError(f"--against {against}: no such checkpoint directory")
    if (against / PACK_MANIFEST).exists():
        raise UsageError(f"--against {against}: is a pack; --against takes the checkpoint the pack was split from")
    ckpt = open_checkpoint(against)
    if ckpt.header_only:
        raise UsageError(f"--against {against}: header-only checkpoint (.safetensors.json); nothing to compare")
    return ckpt


def verify_pack(out_dir: str | os.PathLike, *, deep: bool = False, against: str | os.PathLike | None = None,
                rank: int | None = None, workers: int | None = None) -> VerifyReport:
    """Check the pack at ``out_dir`` and return every problem found (never raises for a bad pack).

    Args:
        deep: also hash each tensor and bank array. against: source checkpoint to compare with.
        rank: check only this rank (a partial pack from ``split --ranks``, or an imported rank).
        workers: hashing threads (default ``min(4, cpus)``).

    Raises:
        UsageError: ``out_dir`` does not exist or is no pack (a checkpoint, say); ``rank`` is
            outside the pack's world; ``against`` is not a checkpoint directory.
        SourceError: the ``against`` checkpoint is malformed (as :func:`~shardsmith.checkpoint.open_checkpoint`).
    """
    t0 = time.perf_counter()
    root = Path(out_dir)
    problems: list[str] = []
    checked: list[int] = []
    summary = ""

    def report(files: int = 0, nbytes: int = 0, compared: int = 0) -> VerifyReport:
        return VerifyReport(str(root), tuple(sorted(set(problems))), tuple(checked), files, nbytes, compared, deep,
                            str(against) if against else None, time.perf_counter() - t0, summary if problems else "")

    unfinished = _check_target(root)
    ckpt = _open_against(Path(against)) if against is not None else None
    if unfinished:
        problems.append(unfinished)
        return report()
    try:
        doc = load_yaml(root / PACK_MANIFEST)
    except ManifestError as e:
        problems.append(f"{PACK_MANIFEST}: {e} (a split that did not finish leaves no pack.yaml)")
        return report()
    problems += check_identity(doc, PACK_MANIFEST)
    world = doc.get("world_size")
    if not isinstance(world, int) or world < 1:
        problems.append(f"{PACK_MANIFEST}: world_size {world!r} is not a positive integer")
        return report()
    if rank is not None and not 0 <= rank < world:
        raise UsageError(f"--rank {rank}: outside [0, {world}) of the pack {root} (world_size={world})")
    plan = _load_plan(root, doc, problems)
    checked = [rank] if rank is not None else list(range(world))
    expected = {PACK_MANIFEST, PLAN_FILE}
    jobs: list = []
    for rec in doc.get("copied_files") or []:
        expected.add(rec["path"])
        if not (root / rec["path"]).is_file():
            problems.append(f"{rec['path']}: missing (copied file)")
        else:
            jobs.append((rec["path"], root / rec["path"], rec.get("bytes"), rec.get("xxh3_128"), []))
    manifests = {r: m for r in checked if (m := _check_rank(root, r, world, doc, plan, problems, jobs, expected))}
    held = [r for r in range(world) if (root / rank_dir(r, world)).is_dir()]
    if rank is None and held and len(held) < world:
        summary = f"pack is incomplete: this pack holds ranks {held} only; pass --rank R to check one"
    problems += _unexpected(root, world, set(checked), expected)

    def run(job: tuple) -> tuple[tuple, int, str, list[str]]:
        where, path, size, _, tensors = job
        if path.stat().st_size != size:
            return job, path.stat().st_size, "", []
        ranges = [(t["offset"], t["offset"] + t["bytes"]) for t in tensors] if deep else []
        n, h, hs = hash_ranges(path, ranges)
        return job, n, h, hs

    nbytes = 0
    with ThreadPoolExecutor(workers or min(4, os.cpu_count() or 1)) as ex:
        for (where, _, size, want, tensors), n, h, hs in ex.map(run, jobs):
            if n != size:
                problems.append(f"{where}: size expected {size} bytes, found {n}" + (" (truncated)" if n < size else ""))
                continue
            nbytes += n
            if h != want:
                problems.append(f"{where}: xxh3_128 expected {want}, found {h}")
            for t, found in zip(tensors, hs):
                if found != t.get("xxh3_128"):
                    problems.append(f"{where}: tensor {t['name']!r} xxh3_128 expected {t.get('xxh3_128')}, found {found}")
    compared = 0
    if ckpt is not None and plan is not None:
        from .verify_against import compare_with_source, source_mismatch

        if differs := source_mismatch(doc, plan, ckpt):
            n = len(differs)
            summary = (f"--against {against} is another checkpoint, not the source of this pack "
                       f"({n} difference{'s' if n != 1 else ''} in identity, first: {differs[0]}); no tensor compared")
            problems += [f"--against: {d}" for d in differs[:MISMATCH_LINES]]
        else:
            more, compared, read = compare_with_source(root, ckpt, doc, plan, manifests)
            problems += more
            nbytes += read
    return report(len(jobs), nbytes, compared)
