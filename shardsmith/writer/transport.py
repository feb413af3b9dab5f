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
from shardsmith.strict_parse import DuplicateKeyError, loads_yaml
from shardsmith.pack.format import PACK_MANIFEST, PLAN_FILE, RANK_MANIFEST, check_identity, rank_dir

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


class _HashingReader:
    """A binary file whose bytes are counted and hashed (XXH3-128) as ``tarfile`` reads them."""

    def __init__(self, fh) -> None:
        self.fh, self.h, self.n = fh, xxhash.xxh3_128(), 0

    def read(self, size: int = -1) -> bytes:
        data = self.fh.read(size)
        self.h.update(data)
        self.n += len(data)
        return data


def _check_archive_path(archive: Path, root: Path, force: bool) -> None:
    """Refuse an archive path that cannot be written, or would overwrite something, before any write."""
    if archive.is_dir():
        raise UsageError(f"{archive}: is a directory; give the archive file to write, e.g. {archive / 'rank.tar.zst'}")
    parent = archive.absolute().parent
    if not parent.is_dir():
        raise UsageError(f"{archive}: directory {parent} does not exist (create it first)")
    if archive.exists() or archive.is_symlink():
        if not force:
            raise UsageError(f"{archive}: exists (pass --force to replace it)")
        if archive.is_symlink() or not archive.is_file():
            raise UsageError(f"{archive}: exists and is not a regular file; --force replaces only an archive")
    if root.resolve() in archive.resolve().parents:
        raise UsageError(f"{archive}: lies inside the pack {root}; write the archive elsewhere")
    tmp = archive.with_name(archive.name + ".partial")
    if tmp.is_symlink() or (tmp.exists() and not tmp.is_file()):
        raise UsageError(f"{tmp}: exists and is not a file; remove it first")


def export_rank(out_dir: str | os.PathLike, rank: int, archive: str | os.PathLike, *, level: int = 3,
                threads: int = 0, force: bool = False) -> TransportResult:
    """Write rank ``rank`` of the pack at ``out_dir`` (plus ``pack.yaml``, ``plan.json`` and the
    copied files) to ``archive`` as ``.tar.zst``; written to ``archive.partial`` and renamed.

    Every file is hashed as it streams into the archive and compared with its manifest record
    (the rank manifest for weight files, ``pack.yaml`` for copied files), so a damaged rank is
    never shipped.

    Args:
        level: zstd level (3 is fast; FP8/FP4 data hardly compresses at any level).
        threads: zstd worker threads (0: one per CPU).
        force: replace an existing ``archive``.

    Raises:
        UsageError: ``out_dir`` is not a directory; ``archive`` is a directory, in a missing
            directory, inside the pack, or exists (without ``force``).
        RuntimeLoadError / ManifestError: as :func:`shardsmith.pack.reader.open_rank`.
        IntegrityError: as :func:`shardsmith.pack.reader.open_rank`, or a file's bytes differ from its
            manifest record (the partial archive is removed).
    """
    import zstandard

    from shardsmith.pack.reader import open_pack, open_rank

    t0 = time.perf_counter()
    root, archive = Path(out_dir), Path(archive)
    if not root.is_dir():
        raise UsageError(f"{root}: no such pack directory")
    _check_archive_path(archive, root, force)
    pack = open_pack(root)
    world = pack.world_size
    if not 0 <= rank < world:
        raise UsageError(f"--rank {rank}: outside [0, {world}) of the pack {root}")
    rp = open_rank(root, rank, world, verify=False)  # paths, links, sizes, headers; hashed below as read
    d = rank_dir(rank, world)
    expect = {c.path: (c.bytes, c.xxh3_128) for c in pack.doc.copied_files}
    expect |= {f"{d}/{rec.path}": (rec.bytes, rec.xxh3_128) for rec in rp.manifest.files}
    names = [PACK_MANIFEST, PLAN_FILE, *(c.path for c in pack.doc.copied_files),
             f"{d}/{RANK_MANIFEST}", *(f"{d}/{rec.path}" for rec in rp.manifest.files)]
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
                        if not info.isfile():  # checked by open_rank; a file swapped for a link since is refused too
                            raise IntegrityError(f"{root / name}: not a regular file (a pack holds no links)")
                        info.uid = info.gid = 0
                        info.uname = info.gname = ""
                        want = expect.get(name)
                        if want is not None and info.size != want[0]:
                            raise IntegrityError(f"{root / name}: size expected {want[0]} bytes, found {info.size}; "
                                                 f"the pack is damaged (shardsmith verify {root} --rank {rank})")
                        with open(root / name, "rb") as f:
                            src = _HashingReader(f)
                            tar.addfile(info, src)
                        if want is not None and (src.n, src.h.hexdigest()) != want:
                            raise IntegrityError(f"{root / name}: (bytes, xxh3_128) expected {want}, found "
                                                 f"{(src.n, src.h.hexdigest())}; the pack is damaged, nothing exported "
                                                 f"(shardsmith verify {root} --rank {rank})")
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


def _check_dest(dest: Path) -> None:
    """Refuse an import destination that import cannot create by renaming a new directory into place.

    Raises:
        UsageError: ``dest`` names no directory of its own (``.``, ``..``, ``/``), is a symlink,
            an existing file, or a non-empty directory.
    """
    if dest.name in ("", ".", ".."):
        raise UsageError(f"{dest}: names an existing directory by '.', '..' or '/'; import creates a new "
                         f"directory: give its name, such as {dest / 'rank-0'}")
    if dest.is_symlink():
        raise UsageError(f"{dest}: is a symlink to {os.readlink(dest)}; import creates a new directory and renames it "
                         f"into place: name a path that does not exist yet (or the directory itself)")
    if dest.exists() and not dest.is_dir():
        raise UsageError(f"{dest}: exists and is a file, not a directory; import creates a directory "
                         f"(remove the file or choose another DEST)")
    if dest.exists() and any(dest.iterdir()):
        raise UsageError(f"{dest}: exists and is not empty; import needs a new or empty directory")


def import_rank(archive: str | os.PathLike, dest: str | os.PathLike) -> TransportResult:
    """Unpack an :func:`export_rank` archive into ``dest``, checking every file's size and hash.

    Raises:
        UsageError: ``archive`` is missing or not a file; ``dest`` is ``.``, a symlink, a file or a
            non-empty directory.
        IntegrityError: damaged, truncated or unexpected content (``dest`` is then not created).
    """
    import yaml
    import zstandard

    t0 = time.perf_counter()
    archive, dest = Path(archive), Path(dest)
    if not archive.exists():
        raise UsageError(f"{archive}: no such archive")
    if not archive.is_file():
        raise UsageError(f"{archive}: not a file (give the .tar.zst written by export)")
    _check_dest(dest)
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
                    pack = loads_yaml(data)
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
                    manifest = loads_yaml(data)
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
    except (zstandard.ZstdError, tarfile.TarError, EOFError, KeyError, TypeError, yaml.YAMLError, DuplicateKeyError,
            ManifestError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise IntegrityError(f"{archive}: damaged or truncated archive: {type(e).__name__}: {e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return TransportResult(str(archive), int(manifest["rank"]), int(manifest["world_size"]), files, raw,
                           archive.stat().st_size, time.perf_counter() - t0)
