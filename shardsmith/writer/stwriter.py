"""A streaming safetensors writer with aligned data, for pack files.

The ``safetensors`` library wants every tensor in memory at once and cannot pad, so packs are
written here instead: entries are declared up front (name, dtype, shape, bytes), which fixes every
offset and the file size; then data is written with ``pwrite`` at any offset, in any order, while
the whole file and each entry are hashed (XXH3-128) in file order.

File layout (:func:`shardsmith.pack.format.layout_file`, which holds the rest of the header
arithmetic; the safetensors format: 8-byte little-endian header length ``N``,
``N`` bytes of header JSON, then the byte buffer), with the two legal additions of ``manifests/README.md``:

- the header JSON is padded with spaces so the byte buffer starts at a multiple of 4096;
- each entry's data starts at a multiple of ``align`` (64 for dense files, 4096 for banks); the
  gaps are zero bytes covered by ``__padding__.<k>`` ``U8`` entries, so the buffer stays gap-free
  as the spec requires.

Hashing in file order with out-of-order writes: bytes written at the hashing position are hashed
straight from the caller's buffer; a write further ahead is only recorded, and once the position
reaches it its bytes are read back with ``pread`` (from the page cache). Expert-bank slots, written
as source tensors arrive, thus cost a re-read only when they arrive out of order.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import xxhash

from shardsmith.errors import IntegrityError
from shardsmith.pack.format import FileLayout

_CHUNK = 8 << 20
_ZEROS = bytes(1 << 20)


@dataclass(frozen=True, slots=True)
class FileDigest:
    """Hashes of a finished file.

    Attributes:
        size: bytes; xxh3_128: hex hash of the whole file; tensors: hex hash per entry name.
    """

    size: int
    xxh3_128: str
    tensors: dict[str, str]


class FileWriter:
    """Write one :class:`FileLayout` to ``path`` with ``pwrite``, hashing in file order.

    The file is created with its final size up front (sparse), the header written, and the
    padding gaps known to be zeros. Thread-safe: several threads may :meth:`write` disjoint
    ranges concurrently.

    Example:
        >>> lay = layout_file([Entry("x", "U8", (3,), 3)], align=64, metadata={})
        >>> w = FileWriter("/tmp/x.safetensors", lay)  # doctest: +SKIP
        >>> w.write(lay.entries[0].offset, b"abc"); d = w.finish()  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike, layout: FileLayout, *, sync: bool = True) -> None:
        self.path = Path(path)
        self.layout = layout
        self._sync = sync
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._closed = False
        os.ftruncate(self._fd, layout.size)
        self._lock = threading.Lock()
        self._pos = 0
        self._pending: dict[int, int] = {}  # offset -> length written ahead (negative: zero gap)
        self._file_h = xxhash.xxh3_128()
        self._bounds = [(e.offset, e.offset + e.nbytes) for e in layout.entries]
        self._hashers = [xxhash.xxh3_128() for _ in layout.entries]
        self._idx = 0
        pos = layout.data_start
        for b, e in self._bounds:
            if b > pos:
                self._pending[pos] = -(b - pos)
            pos = e
        self.write(0, layout.header)

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` at absolute ``offset`` (ranges must not overlap earlier writes)."""
        mv = memoryview(data).cast("B")
        done = 0
        while done < len(mv):
            done += os.pwrite(self._fd, mv[done:], offset + done)
        with self._lock:
            if offset == self._pos:
                self._feed(mv)
                self._drain()
            elif len(mv):
                self._pending[offset] = len(mv)

    def _feed(self, mv: memoryview) -> None:
        start, end = self._pos, self._pos + len(mv)
        self._file_h.update(mv)
        while self._idx < len(self._bounds):
            b, e = self._bounds[self._idx]
            if e > end:
                if b < end:
                    self._hashers[self._idx].update(mv[max(b, start) - start:])
                break
            a = max(b, start)
            if a < e:
                self._hashers[self._idx].update(mv[a - start:e - start])
            self._idx += 1
        self._pos = end

    def _drain(self) -> None:
        while self._pos in self._pending:
            n = self._pending.pop(self._pos)
            if n < 0:
                for k in range(0, -n, len(_ZEROS)):
                    self._feed(memoryview(_ZEROS)[: min(len(_ZEROS), -n - k)])
                continue
            for k in range(0, n, _CHUNK):
                want = min(_CHUNK, n - k)
                got = os.pread(self._fd, want, self._pos)
                if len(got) != want:
                    raise IntegrityError(f"{self.path}: short read-back at offset {self._pos} ({len(got)} of {want} bytes)")
                self._feed(memoryview(got))

    def finish(self) -> FileDigest:
        """Flush (``fsync`` unless ``sync=False``), close and return the hashes.

        Raises:
            IntegrityError: some range of the file was never written.
        """
        with self._lock:
            self._drain()
            pos = self._pos
        try:
            if pos != self.layout.size:
                raise IntegrityError(f"{self.path}: bytes [{pos}, {self.layout.size}) were never written")
            if self._sync:
                os.fsync(self._fd)
        finally:
            self._closed = True
            os.close(self._fd)
        names = [e.name for e in self.layout.entries]
        return FileDigest(self.layout.size, self._file_h.hexdigest(), {n: h.hexdigest() for n, h in zip(names, self._hashers)})

    def abort(self) -> None:
        """Close without checks if still open (the caller discards or resumes the file)."""
        if not self._closed:
            self._closed = True
            os.close(self._fd)
