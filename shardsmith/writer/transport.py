"""Move one rank's pack to its node as a single multi-threaded zstd stream (``.tar.zst``).

The archive is a POSIX tar stream inside one zstd frame (``zstandard``, checksummed) holding, in
order: ``pack.yaml``, ``plan.json``, the copied files, ``rank-R-of-N/manifest.yaml`` and the rank's
weight files. :func:`import_rank` streams it back, checking every file against the manifests that
arrived before it (``pack.yaml`` for plan and copied files, whose own hash is checked first; the
rank manifest, whose hash ``pack.yaml`` records, for weight files) as it writes, all into a
temporary sibling of ``dest`` renamed into place only when every file checked out. A damaged or
truncated archive leaves nothing behind. The result verifies with ``verify DEST --rank R``.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import time
import uuid
from dataclasses import dataclass
from pathlib import PurePosixPath, Path

import xxhash

from ..errors import IntegrityError, ManifestError, UsageError
from .manifest import PACK_MANIFEST, PLAN_FILE, RANK_MANIFEST, check_identity, rank_dir

_BUF = 1 << 20  # tar stream buffer and copy size: tarfile's stream re-slices its buffer per record otherwise


@dataclass(frozen=True, slots=True)
class TransportResult:
    """What an export or import moved.

    Attributes:
        archive: the ``.tar.zst`` path; rank, world_size: the rank moved;
        files: files in the archive; raw_bytes: bytes of those files; archive_bytes: compressed
        bytes; seconds: wall time.
    """

    archive: str
    rank: int
    world_size: int
    files: int
    raw_bytes: int
    archive_bytes: int
    seconds: float

    @property
    def ratio(self) -> float:
        """raw / compressed bytes."""
        return self.raw_bytes / self.archive_bytes if self.archive_bytes else 0.0


def export_rank(out_dir: str | os.PathLike, rank: int, archive: str | os.PathLike, *, level: int = 3,
                threads: int = 0) -> TransportResult:
    """Write rank ``rank`` of the pack at ``out_dir`` (plus ``pack.yaml``, ``plan.json`` and the
    copied files) to ``archive`` as ``.tar.zst``; written to ``archive.partial`` and renamed.

    Args:
        level: zstd level (3 is fast; FP8/FP4 data hardly compresses at any level).
        threads: zstd worker threads (0: one per CPU).

    Raises:
        RuntimeLoadError / ManifestError / IntegrityError: as :func:`shardsmith.pack.open_rank`.
    """
    import zstandard

    from ..pack import open_pack, open_rank

    t0 = time.perf_counter()
    root = Path(out_dir)
    pack = open_pack(root)
    world = pack.world_size
    rp = open_rank(root, rank, world)
    d = rank_dir(rank, world)
    names = [PACK_MANIFEST, PLAN_FILE, *(c["path"] for c in pack.doc.get("copied_files") or []),
             f"{d}/{RANK_MANIFEST}", *(f"{d}/{rec['path']}" for rec in rp.manifest["files"])]
    archive = Path(archive)
    tmp = archive.with_name(archive.name + ".partial")
    raw_bytes = 0
    cctx = zstandard.ZstdCompressor(level=level, threads=threads or -1, write_checksum=True)
    try:
        with open(tmp, "wb") as fh:
            with cctx.stream_writer(fh, closefd=False) as zw:
                with tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT, bufsize=_BUF,
                                  copybufsize=_BUF) as tar:
                    for name in names:
                        info = tar.gettarinfo(str(root / name), arcname=name)
                        info.uid = info.gid = 0
                        info.uname = info.gname = ""
                        with open(root / name, "rb") as f:
                            tar.addfile(info, f)
                        raw_bytes += info.size
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, archive)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return TransportResult(str(archive), rank, world, len(names), raw_bytes, archive.stat().st_size, time.perf_counter() - t0)


def _safe(name: str) -> str:
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or "\\" in name or not p.parts:
        raise IntegrityError(f"archive member {name!r} is not a safe relative path")
    return p.as_posix()


def _extract(tar: tarfile.TarFile, member: tarfile.TarInfo, dst: Path) -> tuple[int, str, bytes | None]:
    """Write ``member`` to ``dst`` while hashing; keep the bytes of small YAML documents."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    src = tar.extractfile(member)
    h, n, keep = xxhash.xxh3_128(), 0, [] if dst.suffix == ".yaml" else None
    with open(dst, "wb") as out:
        while chunk := src.read(_BUF):
            h.update(chunk)
            out.write(chunk)
            n += len(chunk)
            if keep is not None:
                keep.append(chunk)
        out.flush()
        os.fsync(out.fileno())
    return n, h.hexdigest(), b"".join(keep) if keep is not None else None


def import_rank(archive: str | os.PathLike, dest: str | os.PathLike) -> TransportResult:
    """Unpack an :func:`export_rank` archive into ``dest``, checking every file's size and hash.

    Raises:
        UsageError: ``dest`` exists and is not empty.
        IntegrityError: damaged, truncated or unexpected content (``dest`` is then not created).
    """
    import yaml
    import zstandard

    t0 = time.perf_counter()
    archive, dest = Path(archive), Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UsageError(f"{dest}: exists and is not empty")
    tmp = dest.with_name(f".{dest.name}.import-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    expect: dict[str, tuple[int, str]] = {}
    manifests: dict[str, str] = {}  # rank manifest path -> its own hash as pack.yaml records it
    pack = manifest = None
    files = raw = 0
    try:
        with open(archive, "rb") as fh, zstandard.ZstdDecompressor().stream_reader(fh) as zr, \
                tarfile.open(fileobj=zr, mode="r|", bufsize=_BUF, copybufsize=_BUF) as tar:
            for member in tar:
                name = _safe(member.name)
                if not member.isfile():
                    raise IntegrityError(f"archive member {name!r} is not a regular file")
                if (pack is None) != (name == PACK_MANIFEST):
                    raise IntegrityError(f"archive member {name!r}: expected {PACK_MANIFEST} first and only once")
                if name != PACK_MANIFEST and name not in expect and name not in manifests:
                    raise IntegrityError(f"archive member {name!r} is not listed by the manifests that precede it")
                n, h, data = _extract(tar, member, tmp / name)
                files, raw = files + 1, raw + n
                if name in expect:
                    want = expect.pop(name)
                    if (n, h) != want:
                        raise IntegrityError(f"{name}: (bytes, xxh3_128) expected {want}, found {(n, h)}")
                if name == PACK_MANIFEST:
                    pack = yaml.safe_load(data)
                    problems = check_identity(pack, PACK_MANIFEST) if isinstance(pack, dict) else ["not a mapping"]
                    if problems:
                        raise IntegrityError(f"{PACK_MANIFEST}: {'; '.join(problems)}")
                    p = pack.get("plan") or {}
                    expect[PLAN_FILE] = (p.get("bytes"), p.get("xxh3_128"))
                    expect.update({c["path"]: (c["bytes"], c["xxh3_128"]) for c in pack.get("copied_files") or []})
                    world = pack["world_size"]
                    for r in pack.get("ranks") or []:
                        if r.get("manifest_xxh3_128"):
                            manifests[f"{rank_dir(r['rank'], world)}/{RANK_MANIFEST}"] = r["manifest_xxh3_128"]
                elif name in manifests:
                    if manifest is not None:
                        raise IntegrityError(f"{name}: a second rank in an archive of one rank")
                    manifest = yaml.safe_load(data)
                    problems = check_identity(manifest, name) if isinstance(manifest, dict) else ["not a mapping"]
                    if not problems and manifest["manifest_xxh3_128"] != manifests[name]:
                        problems = [f"hash expected {manifests[name]} (pack.yaml), found {manifest['manifest_xxh3_128']}"]
                    if problems:
                        raise IntegrityError(f"{name}: bad rank manifest: {'; '.join(problems)}")
                    d = name.rsplit("/", 1)[0]
                    expect.update({f"{d}/{f['path']}": (f["bytes"], f["xxh3_128"]) for f in manifest["files"]})
        if pack is None or manifest is None or expect:
            raise IntegrityError(f"archive incomplete: missing {sorted(expect) or 'its manifests'}")
        if dest.exists():
            dest.rmdir()
        os.replace(tmp, dest)
    except (zstandard.ZstdError, tarfile.TarError, EOFError, KeyError, TypeError, yaml.YAMLError, ManifestError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise IntegrityError(f"{archive}: damaged or truncated archive: {type(e).__name__}: {e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return TransportResult(str(archive), int(manifest["rank"]), int(manifest["world_size"]), files, raw,
                           archive.stat().st_size, time.perf_counter() - t0)
