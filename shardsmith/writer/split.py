"""``split``: stream a checkpoint once and write per-rank packs, atomically and resumably.

Data flow. The main thread reads the source shards sequentially, one tensor at a time in
(file, offset) order, hashing every byte of every shard (header included) for ``pack.yaml``. Each
tensor goes to a small thread pool that cuts the shard of every selected rank (a view when the
shard is contiguous in the source, else one copy, as :func:`~shardsmith.pack.banks.cut`) and
``pwrite``s it to its destination: a dense file, or its slot in a layer's expert bank, whose file
was laid out with its final size before any data (:mod:`.layout`). :class:`~.stwriter.FileWriter`
hashes each file and tensor in file order as bytes land; files are fsynced together at the end
(the journal needs no earlier flush: resume re-hashes what it reuses). Hashing, ``pread``/``pwrite`` and numpy
copies release the GIL, so reading, cutting, hashing and writing overlap.

Memory bound. Source tensors in flight are capped at ``window = max(L, 256 MiB)`` bytes (``L`` the
largest source tensor; one larger tensor is admitted alone), and each worker holds at most one
rank's strided copy (``<= L``) at a time, so peak RSS is about ``window + workers * L`` plus the
interpreter (~100 MB), whatever the model size or world size: ``<= 3 L + 256 MiB`` with the
default 2 workers. Nothing holds a whole rank in memory.

Atomicity. Work happens in ``OUT.partial/`` beside ``OUT``; ``pack.yaml`` is written last and the
directory renamed to ``OUT`` only when everything is written, hashed and fsynced, so an interrupted
split leaves no ``OUT`` at all. ``resume=True`` reuses the weight files the journal
(:mod:`.journal`) lists as finished once their hashes check out, and reads only the source shards
still needed.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import xxhash

from ..checkpoint import open_checkpoint, slice_bytes
from ..errors import SourceError, UsageError
from ..pack.format import PACK_MANIFEST, load_yaml
from ..plans import plan_checkpoint
from ..plans.resolve import TensorPlan
from .journal import Journal
from .layout import DEFAULT_MAX_FILE_BYTES, PackLayout, layout_pack
from .outdir import check_out, finished_pack, partial_dir, split_lock
from .packdocs import finalize_pack, plan_json
from ..pack.banks import cut
from .stwriter import FileWriter

MIN_WINDOW = 256 << 20
Progress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class SplitResult:
    """What a split did.

    Attributes:
        out_dir: the pack directory; pack_id: its identity; world_size, ranks: ranks written.
        files_written / files_reused: weight files written now / kept from a resumed run.
        bytes_read: source bytes read; bytes_written: bytes of weight files written now.
        seconds: wall time; window_bytes: the in-flight source cap (see the module docstring).
        notes: what resume dropped or decided.
        already_complete: ``resume`` found this very split finished at ``out_dir`` and did nothing.
    """

    out_dir: str
    pack_id: str
    world_size: int
    ranks: tuple[int, ...]
    files_written: int
    files_reused: int
    bytes_read: int
    bytes_written: int
    seconds: float
    window_bytes: int
    notes: tuple[str, ...] = field(default=())
    already_complete: bool = False


def shard_pieces(raw: np.ndarray, tp: TensorPlan, rank: int) -> list[np.ndarray]:
    """Rank ``rank``'s shard of source bytes ``raw`` as contiguous pieces written back to back.

    Views of ``raw`` when the shard is contiguous in the source (replicated tensors, dim-0 cuts),
    else one fresh copy from :func:`~shardsmith.pack.banks.cut`.
    """
    if tp.shard_dim is None:
        return [raw]
    parts = [slice_bytes(raw, tp.dtype, tp.shape, tp.shard_dim, s, n, name=tp.name) for s, n in tp.ranges[rank]]
    if all(p.shape[0] == 1 for p in parts) or (len(parts) == 1 and parts[0].flags.c_contiguous):
        return [p.reshape(-1) for p in parts]
    return [cut(raw, tp, rank)]


def _check_args(world_size: int, align: int, ranks: tuple[int, ...] | None, max_file_bytes: int, workers: int | None) -> None:
    """Raise :class:`UsageError` for bad arguments, before anything is read or written."""
    if not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"--tp must be at least 1, got {world_size}")  # the words of `plan --tp 0`
    if not isinstance(align, int) or align < 1:
        raise UsageError(f"--align must be at least 1, got {align}")
    if ranks is not None and (not ranks or any(not 0 <= r < world_size for r in ranks)):
        raise UsageError(f"--ranks {','.join(map(str, ranks))}: each rank must be in [0, {world_size})")
    if max_file_bytes <= 0:
        raise UsageError(f"--max-file-bytes {max_file_bytes}: must be > 0")
    if workers is not None and workers < 0:
        raise UsageError(f"--workers {workers}: must be >= 0 (0: min(4, CPUs))")


class _Window:
    """A byte budget for source tensors in flight."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used, self.cv = limit, 0, threading.Condition()

    def take(self, n: int, failed: threading.Event) -> None:
        with self.cv:
            while self.used and self.used + n > self.limit and not failed.is_set():
                self.cv.wait(0.5)
            self.used += n

    def give(self, n: int) -> None:
        with self.cv:
            self.used -= n
            self.cv.notify_all()


def split_checkpoint(
    ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, world_size: int, align: int = 1,
    ranks: tuple[int, ...] | None = None, resume: bool = False, force: bool = False,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, workers: int | None = None, progress: Progress | None = None,
) -> SplitResult:
    """Split checkpoint ``ckpt_dir`` into ``out_dir/rank-<r>-of-<world_size>/`` packs.

    Args:
        world_size: tensor-parallel ranks; align: cut unit in logical elements (``--align``).
        ranks: write only these ranks (``pack.yaml`` still lists all; verify with ``rank=``).
        resume: reuse finished files of an interrupted split into the same ``out_dir``; with no
            ``OUT.partial`` and this very split finished at ``out_dir``, return at once saying so
            (``files_written`` 0, a note).
        force: replace an existing pack (or partial split) at ``out_dir``; never anything else
            (:mod:`.outdir`).
        max_file_bytes: size at which a rank's dense tensors start a new file.
        workers: cutting/writing threads (``None`` or 0: ``min(4, cpus)``).
        progress: called with ``(bytes_done, bytes_total)`` of source data as tensors finish.

    Returns:
        a :class:`SplitResult`.

    Raises:
        SourceError: invalid or header-only checkpoint. PlanError: no valid plan at ``world_size``.
        UsageError: bad ``world_size``, ``ranks``, ``max_file_bytes`` or ``workers``; ``out_dir`` is, holds
            or lies inside the source, or exists and is not empty (without ``force``, or not a pack);
            another split is writing ``out_dir`` (:func:`~.outdir.split_lock`).
    """
    out = Path(out_dir)
    _check_args(world_size, align, ranks, max_file_bytes, workers)
    if not out.parent.is_dir():  # the lock lives beside OUT: make its parent, once OUT is known to be allowed
        src = open_checkpoint(ckpt_dir)
        check_out(src.root, [f.path for f in src.files.values()], out, force=force)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)  # as OUT.partial's would be
        except OSError as e:
            raise UsageError(f"{out}: cannot create its parent directory: {e.strerror}") from None
    with split_lock(out):
        return _split(ckpt_dir, out, world_size=world_size, align=align, ranks=ranks, resume=resume, force=force,
                      max_file_bytes=max_file_bytes, workers=workers, progress=progress)


def _split(ckpt_dir, out: Path, *, world_size: int, align: int, ranks, resume: bool, force: bool,
           max_file_bytes: int, workers: int | None, progress) -> SplitResult:
    """:func:`split_checkpoint` under the lock of ``out``."""
    t0 = time.perf_counter()
    ckpt = open_checkpoint(ckpt_dir)
    if ckpt.header_only:
        n = sum(f.header_only for f in ckpt.files.values())
        raise SourceError(f"{ckpt.root}: {n} of {len(ckpt.files)} shard(s) are header-only (.safetensors.json); "
                          f"split needs the tensor data (download the shards first)")
    shards = [f.path for f in ckpt.files.values()]
    partial = partial_dir(out)
    # --resume after the final rename: OUT holds a pack and no OUT.partial is left (checked below)
    finished = (resume and not force and not partial.exists() and not out.is_symlink()
                and (out / PACK_MANIFEST).is_file())
    check_out(ckpt.root, shards, out, force=force or finished)
    plan = plan_checkpoint(ckpt, world_size, align=align)
    layout = layout_pack(plan, ranks=ranks, max_file_bytes=max_file_bytes)
    plan_bytes = plan_json(plan)
    if finished:
        why = finished_pack(out, plan_hash=xxhash.xxh3_128(plan_bytes).hexdigest(), world_size=world_size,
                            ranks=layout.ranks, sources=[(f.name, f.path) for f in ckpt.files.values()])
        if why is not None:
            raise UsageError(f"{out}: holds a finished pack of another split ({why}); --resume continues only the "
                             f"same split: pass --force to replace it")
        return SplitResult(str(out), str(load_yaml(out / PACK_MANIFEST).get("pack_id")), world_size, layout.ranks,
                           0, len(layout.files), 0, 0, time.perf_counter() - t0, 0,
                           (f"{out} already holds this finished pack (same plan, ranks and source files): nothing to "
                            f"resume; `shardsmith verify {out}` checks it",), already_complete=True)
    key = {"format_version": 1, "plan_xxh3_128": xxhash.xxh3_128(plan_bytes).hexdigest(),
           "ranks": list(layout.ranks), "max_file_bytes": max_file_bytes,
           "source": [[f.name, f.size, f.path.stat().st_mtime_ns] for f in ckpt.files.values()]}
    workers = workers or min(4, os.cpu_count() or 1)
    notes: list[str] = []
    if resume and partial.is_dir():
        journal, notes = Journal.resume(partial, key, workers=workers)
        if not journal.files and not journal.sources:
            shutil.rmtree(partial)
    else:
        if partial.exists():
            shutil.rmtree(partial)
        journal = Journal(partial, key)
    partial.mkdir(parents=True, exist_ok=True)
    for r in layout.ranks:
        (partial / f"rank-{r}-of-{world_size}").mkdir(exist_ok=True)
    journal.open()
    try:
        stats = _stream(ckpt, plan, layout, partial, journal, workers, progress)
        journal.close()
        pack_id = finalize_pack(ckpt, plan, layout, partial, plan_bytes, journal)
    finally:
        journal.close()
    (partial / "journal.jsonl").unlink()
    check_out(ckpt.root, shards, out, force=force)  # again: OUT may have appeared while we worked
    if out.exists():
        shutil.rmtree(out)  # a pack or an empty directory (check_out)
    os.replace(partial, out)
    _fsync(out.parent)
    reused = sum(1 for p in layout.files if p in journal.files) - stats["written"]
    return SplitResult(str(out), pack_id, world_size, layout.ranks, stats["written"], reused, stats["read"],
                       stats["bytes_written"], time.perf_counter() - t0, stats["window"], tuple(notes))


@contextmanager
def _failing(failed: threading.Event) -> Iterator[None]:
    """Set ``failed`` when the block raises (``KeyboardInterrupt`` included), then re-raise."""
    try:
        yield
    except BaseException:
        failed.set()
        raise


def _fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _stream(ckpt, plan, layout: PackLayout, root: Path, journal: Journal, workers: int, progress: Progress | None) -> dict:
    """Read the needed source shards once and write every unfinished file. Returns counters."""
    todo_files = {p for p in layout.files if p not in journal.files}
    remaining = {p: 0 for p in todo_files}
    jobs: dict[str, list] = {}  # source tensor -> targets still to write
    for name, targets in layout.targets.items():
        ts = [t for t in targets if t.file in todo_files]
        if ts:
            jobs[name] = ts
            for t in ts:
                remaining[t.file] += 1
    by_file: dict[str, list] = {}
    for info in ckpt.tensors.values():
        by_file.setdefault(info.file, []).append(info)
    shards = [s for s in ckpt.files.values() if s.name not in journal.sources or any(i.name in jobs for i in by_file.get(s.name, []))]
    total = sum(i.nbytes for s in shards for i in by_file.get(s.name, []))
    largest = max((i.nbytes for i in ckpt.tensors.values()), default=0)
    window = _Window(max(largest, MIN_WINDOW))
    writers = {p: FileWriter(root / p, layout.files[p].layout, sync=False) for p in sorted(todo_files)}
    lock, failed, errors = threading.Lock(), threading.Event(), []
    done = [0, 0]  # source bytes processed, weight files written

    def finish(path: str) -> None:
        journal.file_done(path, writers[path].finish())

    def work(name: str, raw: np.ndarray) -> None:
        try:
            if failed.is_set():
                return
            tp = plan.tensors[name]
            ready = []
            for t in jobs.get(name, ()):
                off = t.offset
                for piece in shard_pieces(raw, tp, t.rank):
                    writers[t.file].write(off, piece)
                    off += piece.nbytes
                with lock:
                    remaining[t.file] -= 1
                    if remaining[t.file] == 0:
                        ready.append(t.file)
            for path in ready:
                finish(path)
            with lock:
                done[0] += raw.nbytes
                d = done[0]
            if progress:
                progress(d, total)
        except BaseException as e:  # noqa: BLE001 - re-raised by the reader
            errors.append(e)
            failed.set()
        finally:
            window.give(raw.nbytes)

    try:
        # on Ctrl-C or a read error, _failing sets `failed` before the pool waits on its queue, so
        # queued tensors are dropped, not written
        with ThreadPoolExecutor(workers, thread_name_prefix="split") as pool, _failing(failed):
            for p in [p for p, n in remaining.items() if n == 0]:
                finish(p)
            for shard in shards:
                h = xxhash.xxh3_128()
                with open(shard.path, "rb", buffering=0) as fh:
                    head = fh.read(shard.data_start)
                    h.update(head)
                    for info in sorted(by_file.get(shard.name, []), key=lambda i: i.offset):
                        if failed.is_set():
                            break
                        window.take(info.nbytes, failed)
                        buf = np.empty(info.nbytes, dtype=np.uint8)
                        fh.seek(info.offset)
                        mv, got = memoryview(buf), 0
                        while got < info.nbytes and (k := fh.readinto(mv[got:])):
                            got += k
                        if got != info.nbytes:
                            window.give(info.nbytes)
                            raise SourceError(f"{shard.path}: tensor {info.name!r} truncated ({got} of {info.nbytes} bytes)")
                        h.update(mv)
                        if info.name in jobs:
                            pool.submit(work, info.name, buf)
                        else:
                            with lock:
                                done[0] += info.nbytes
                            window.give(info.nbytes)
                if failed.is_set():
                    break
                journal.source_done(shard.name, shard.size, h.hexdigest())
    finally:
        for w in writers.values():
            w.abort()
    if errors:
        raise errors[0]
    written = [p for p in todo_files if p in journal.files]
    with ThreadPoolExecutor(workers) as pool:  # one flush at the end lets the kernel write back in bulk
        list(pool.map(lambda p: _fsync(root / p), written))
    return {"read": total, "written": len(written), "window": window.limit,
            "bytes_written": sum(layout.files[p].layout.size for p in written)}
