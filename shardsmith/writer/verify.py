"""``verify``: prove a pack intact and complete, collecting every problem instead of stopping.

Checks (each problem names the file, the tensor where there is one, and expected vs found):

- ``pack.yaml``: schema (:mod:`shardsmith.pack.records`: types, ranges, no unknown or missing
  key, fields that must agree with each other), format, version, own hash, and with ``expect`` its
  root digest; ``plan.json``: bytes and XXH3-128 as recorded;
- plan values and coverage from ``plan.json`` alone (:mod:`shardsmith.pack.coverage`);
- every path a manifest names: inside the pack, no symbolic link anywhere under the pack root,
  regular files only (:mod:`shardsmith.pack.check`, the rank check the loader runs too);
- every rank of the world present (only rank ``rank`` with ``rank=``); each ``manifest.yaml``:
  format, own hash, rank, world size, ``pack_id``, and its hash as ``pack.yaml`` records it;
- each manifest lists exactly the tensors and bank arrays the plan gives its rank, with the plan's
  dtypes and rank-local shapes (:func:`shardsmith.pack.banks.expected_entries`);
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

from shardsmith.errors import UsageError
from shardsmith.pack.check import HashJob, check_rank, copied_file_jobs
from shardsmith.pack.format import PACK_MANIFEST, PLAN_FILE, rank_dir
from shardsmith.pack.reader import load_plan, read_pack_manifest

from .outdir import rank_of_pack, unfinished_split

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


def _unexpected(root: Path, world: int, selected: set[int], expected: set[str], links: set[str]) -> list[str]:
    """Files and directories under ``root`` no manifest accounts for, and every symbolic link
    (except those in ``links``, already reported)."""
    out = []
    parents = {str(Path(p).parent) for p in expected}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root).as_posix()
        keep = []
        for dn in sorted(dirnames):
            sub = dn if rel == "." else f"{rel}/{dn}"
            m = RANK_DIR.fullmatch(dn) if rel == "." else None
            if os.path.islink(os.path.join(dirpath, dn)):
                if sub not in links:
                    out.append(f"{sub}: is a symbolic link; a pack holds no links")
            elif m and int(m.group(2)) != world:
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
            if os.path.islink(os.path.join(dirpath, fn)):
                if sub not in links:
                    out.append(f"{sub}: is a symbolic link; a pack holds no links")
            elif sub not in expected:
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
                rank: int | None = None, workers: int | None = None, expect: str | None = None) -> VerifyReport:
    """Check the pack at ``out_dir`` and return every problem found (never raises for a bad pack).

    Every path is checked (:mod:`shardsmith.pack.check`: inside the pack, no symbolic link, a
    regular file of the recorded size) before it is opened; ``against`` compares only ranks whose
    checks all passed.

    Args:
        deep: also hash each tensor and bank array. against: source checkpoint to compare with.
        rank: check only this rank (a partial pack from ``split --ranks``, or an imported rank).
        workers: hashing threads (default ``min(4, cpus)``).
        expect: the root digest the pack must have (``split`` prints it; :func:`~shardsmith.pack.format.root_digest`).

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
    doc, digest = read_pack_manifest(root, problems)
    if doc is None:
        return report()
    if expect is not None and digest != expect.strip().lower():
        problems.append(f"{PACK_MANIFEST}: root digest expected {expect}, found {digest} (not the pack that digest pins)")
    world = doc.world_size
    if rank is not None and not 0 <= rank < world:
        raise UsageError(f"--rank {rank}: outside [0, {world}) of the pack {root} (world_size={world})")
    plan = load_plan(root, doc, problems)
    checked = [rank] if rank is not None else list(range(world))
    expected = {PACK_MANIFEST, PLAN_FILE}
    jobs: list[HashJob] = copied_file_jobs(root, doc, problems, expected)
    manifests = {}
    for r in checked:
        chk = check_rank(root, doc, plan, r)
        problems.extend(chk.problems)
        jobs += chk.jobs
        expected |= chk.expected
        if chk.opaque:  # an unparsable manifest: its rank's files are not each "unexpected"
            d = rank_dir(r, world)
            expected |= {f"{d}/{f.name}" for f in (root / d).iterdir() if not f.is_symlink() and f.is_file()}
        if chk.manifest is not None:
            manifests[r] = chk.manifest
    held = [r for r in range(world) if os.path.lexists(root / rank_dir(r, world))]
    if rank is None and held and len(held) < world:
        summary = f"pack is incomplete: this pack holds ranks {held} only; pass --rank R to check one"
    links = {p.split(": ")[0] for p in problems if "symbolic link" in p}
    problems += _unexpected(root, world, set(checked), expected, links)

    def run(job: HashJob) -> tuple[HashJob, int, str, list[str]]:
        ranges = [(t.offset, t.offset + t.bytes) for t in job.tensors] if deep else []
        n, h, hs = hash_ranges(job.path, ranges)
        return job, n, h, hs

    nbytes = 0
    with ThreadPoolExecutor(workers or min(4, os.cpu_count() or 1)) as ex:
        for job, n, h, hs in ex.map(run, jobs):
            if n != job.bytes:
                problems.append(f"{job.where}: size expected {job.bytes} bytes, found {n} (changed while verifying)")
                continue
            nbytes += n
            if h != job.xxh3_128:
                problems.append(f"{job.where}: xxh3_128 expected {job.xxh3_128}, found {h}")
            for t, found in zip(job.tensors, hs):
                if found != t.xxh3_128:
                    problems.append(f"{job.where}: tensor {t.name!r} xxh3_128 expected {t.xxh3_128}, found {found}")
    compared = 0
    if ckpt is not None and plan is not None:
        from .verify_against import compare_with_source, source_mismatch

        safe = {r: m for r, m in manifests.items() if not any(p.startswith(rank_dir(r, world)) for p in problems)}
        if differs := source_mismatch(doc, plan, ckpt):
            n = len(differs)
            summary = (f"--against {against} is another checkpoint, not the source of this pack "
                       f"({n} difference{'s' if n != 1 else ''} in identity, first: {differs[0]}); no tensor compared")
            problems += [f"--against: {d}" for d in differs[:MISMATCH_LINES]]
        elif safe:
            more, compared, read = compare_with_source(root, ckpt, doc, plan, safe)
            problems += more
            nbytes += read
    return report(len(jobs), nbytes, compared)
