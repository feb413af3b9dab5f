"""Where ``split`` may write: refuse, before any write, an ``OUT`` that would destroy data.

``split`` builds ``OUT.partial/`` beside ``OUT`` and renames it over ``OUT``, removing what was
there. Rules (symlinks resolved before comparing paths):

- ``OUT`` and ``OUT.partial`` must not be the checkpoint directory, contain it, lie inside it, or
  contain a source shard (Hugging Face caches link shards into ``../../blobs``);
- an existing ``OUT`` must be a directory, not a symlink; ``force`` replaces it only when it is
  empty, a pack (holds ``pack.yaml``) or a partial split of ours;
- an existing ``OUT.partial`` (restarted or resumed) must be a partial split of ours: empty, or
  holding ``journal.jsonl``, ``pack.yaml`` or only ``rank-<r>-of-<N>`` directories and the
  journal's temporary file (a split killed while writing its first journal);
- ``--resume`` with no ``OUT.partial`` and a finished pack at ``OUT`` of the same split (plan hash,
  ranks, source file names and sizes, no source newer than the pack) has nothing left to do
  (:func:`finished_pack`).
"""

from __future__ import annotations

import fcntl
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import ManifestError, UsageError
from ..pack.format import PACK_MANIFEST, load_yaml
from .journal import JOURNAL, JOURNAL_TMP

_RANK_DIR = re.compile(r"rank-\d+-of-\d+")


def partial_dir(out: Path) -> Path:
    """``OUT.partial``, the working directory of a split into ``out``."""
    return out.with_name(out.name + ".partial")


def is_ours(d: Path) -> bool:
    """True when directory ``d`` is empty, a pack, or a partial split written by shardsmith."""
    names = {p.name: p for p in d.iterdir()}
    if not names or PACK_MANIFEST in names or JOURNAL in names:
        return True
    return all((_RANK_DIR.fullmatch(n) and p.is_dir() and not p.is_symlink())
               or (n == JOURNAL_TMP and p.is_file() and not p.is_symlink()) for n, p in names.items())


def finished_pack(out: Path, *, plan_hash: str, world_size: int, ranks: tuple[int, ...],
                  sources: list[tuple[str, Path]]) -> str | None:
    """Whether ``out`` already holds the finished pack this split would write.

    Args:
        plan_hash: XXH3-128 of the plan file this split writes; ranks: the ranks it writes;
        sources: the source shards as (index name, path), in index order.

    Returns:
        ``None`` when ``out/pack.yaml`` records the same plan hash, world size, ranks and source
        files (names and sizes) and no source file is newer than it; else why not (one phrase).
    """
    manifest = out / PACK_MANIFEST
    try:
        doc = load_yaml(manifest)
    except ManifestError as e:
        return f"its {PACK_MANIFEST} cannot be read: {e}"
    plan = doc.get("plan") if isinstance(doc.get("plan"), dict) else {}
    src = doc.get("source") if isinstance(doc.get("source"), dict) else {}
    files = src.get("files") if isinstance(src.get("files"), list) else []
    recorded = [(f.get("name"), f.get("bytes")) for f in files if isinstance(f, dict)]
    if plan.get("xxh3_128") != plan_hash or doc.get("world_size") != world_size:
        return "another plan or world size"
    if doc.get("ranks_written") != list(ranks):
        return f"ranks {doc.get('ranks_written')!r} written, this split writes {list(ranks)}"
    if recorded != [(name, path.stat().st_size) for name, path in sources]:
        return "other source files or sizes"
    newest = max((path.stat().st_mtime_ns for _, path in sources), default=0)
    if newest > manifest.stat().st_mtime_ns:
        return "a source file changed after the pack was written"
    return None


def _overlap(target: Path, protected: Path, what: str, flag: str) -> str | None:
    t, p = target.resolve(), protected.resolve()
    if t == p:
        return f"{flag} {target} is {what} {protected}"
    if t in p.parents:
        return f"{flag} {target} contains {what} {protected}"
    if p in t.parents:
        return f"{flag} {target} lies inside {what} {protected}"
    return None


def check_out(ckpt_root: Path, shards: list[Path], out: Path, *, force: bool) -> None:
    """Refuse ``out`` (and ``OUT.partial``) unless replacing them can only lose our own output.

    Args:
        ckpt_root: the source checkpoint directory; shards: its shard files (symlinks followed).
        out: the pack directory to create; force: replace an existing pack or partial split.

    Raises:
        UsageError: naming the path and the rule it breaks.
    """
    partial = partial_dir(out)
    for target, flag in ((out, "OUT"), (partial, "OUT.partial")):
        why = _overlap(target, ckpt_root, "the checkpoint", flag)
        for shard in shards:
            if why is None and target.resolve() in shard.resolve().parents:
                why = f"{flag} {target} contains source shard {shard.resolve()}"
        if why:
            raise UsageError(f"{why} (resolved: {target.resolve()}): split would overwrite its own source; "
                             f"choose an OUT outside the checkpoint")
    if out.is_symlink():
        raise UsageError(f"{out}: is a symlink to {out.readlink()}; name the directory itself")
    if out.exists():
        if not out.is_dir():
            raise UsageError(f"{out}: exists and is not a directory; split writes a directory (remove it first)")
        if not force and any(out.iterdir()) and is_ours(out):
            raise UsageError(f"{out}: exists and holds a pack (pass --force to replace it)")
        if any(out.iterdir()) and not is_ours(out):
            raise UsageError(f"{out}: exists, is not empty and is not a shardsmith pack (no {PACK_MANIFEST}); "
                             f"--force only replaces a pack or an empty directory: remove it yourself if it is not needed")
    if partial.is_symlink() or (partial.exists() and not (partial.is_dir() and is_ours(partial))):
        raise UsageError(f"{partial}: exists and is not a partial split of shardsmith (no {JOURNAL}); "
                         f"split works there, so remove or rename it first")


def unfinished_split(root: Path) -> str | None:
    """A problem line when ``root`` is the ``OUT.partial`` of an interrupted split, else ``None``.

    ``root`` counts as one when its name ends in ``.partial``, it has no ``pack.yaml`` and
    :func:`is_ours` holds (a journal, or only rank directories and the journal's temporary file).
    """
    if not (root.name.endswith(".partial") and root.is_dir() and not root.is_symlink()):
        return None
    if (root / PACK_MANIFEST).exists() or not any(root.iterdir()) or not is_ours(root):
        return None
    out = root.with_name(root.name[: -len(".partial")])
    return (f"{root}: an unfinished split into {out} (no {PACK_MANIFEST} yet): rerun the same `shardsmith split` "
            f"with --resume to continue it")


def rank_of_pack(root: Path) -> tuple[int, int, Path] | None:
    """``(rank, world_size, pack)`` when ``root`` is a ``rank-<r>-of-<N>`` directory of the pack one
    level up (its parent holds ``pack.yaml``), else ``None``."""
    m = re.fullmatch(r"rank-(\d+)-of-(\d+)", root.resolve().name)
    parent = root.resolve().parent
    if m is None or not (parent / PACK_MANIFEST).is_file():
        return None
    return int(m.group(1)), int(m.group(2)), parent


@contextmanager
def split_lock(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``out`` for one ``split`` (``.<OUT>.split-lock`` beside it, ``flock``).

    Two splits into one ``OUT`` would delete each other's ``OUT.partial`` mid-write; the second is
    refused before it touches anything. The lock is the kernel's, so a killed split never leaves
    ``OUT`` locked; the lock file is removed when the split ends (a split killed by SIGKILL leaves
    the empty file, which locks nothing). After locking, the file must still be the one at the path
    (another split may have removed it in between): else lock again.

    Raises:
        UsageError: another process holds the lock (its pid named).
    """
    path = out.parent / f".{out.name}.split-lock"
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UsageError(f"{out}: cannot create the split lock {path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UsageError(f"{out}: another split is writing it (pid {holder}, lock {path}); wait for it to end "
                             f"or stop it, then run split again (--resume continues its work)") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # locked a file another split had just removed: take the one at the path
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        try:
            os.unlink(path)  # while still holding it: a split that opened it meanwhile sees another inode
        except FileNotFoundError:
            pass
        os.close(fd)
