"""A streaming safetensors writer with aligned data, for pack files.

The ``safetensors`` library wants every tensor in memory at once and cannot pad, so packs are
written here instead: entries are declared up front (name, dtype, shape, bytes), which fixes every
offset and the file size; then data is written with ``pwrite`` at any offset, in any order, while
the whole file and each entry are hashed (XXH3-128) in file order.

File layout (the safetensors format: 8-byte little-endian header length ``N``, ``N`` bytes of
header JSON, then the byte buffer), with the two legal additions of ``manifests/README.md``:

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

import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import xxhash

from ..errors import IntegrityError, UsageError

DATA_START_ALIGN = 4096
PADDING_PREFIX = "__padding__."
_CHUNK = 8 << 20
_ZEROS = bytes(1 << 20)


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of a file, declared before any data is written.

    Attributes:
        name: tensor name; dtype: safetensors dtype; shape: header shape; nbytes: data bytes.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class Placed:
    """An :class:`Entry` with its absolute byte offset in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int


@dataclass(frozen=True, slots=True)
class FileLayout:
    """A file's bytes before any data: header and where each entry goes.

    Attributes:
        header: the 8-byte length plus the space-padded header JSON (``data_start`` bytes).
        entries: the real entries (no padding), in file order, offsets absolute.
        size: total file bytes.
    """

    header: bytes
    entries: tuple[Placed, ...]
    size: int

    @property
    def data_start(self) -> int:
        """Absolute offset of the byte buffer (a multiple of 4096)."""
        return len(self.header)


def layout_file(entries: list[Entry], *, align: int, metadata: dict[str, str]) -> FileLayout:
    """Place ``entries`` in order, each on an ``align``-byte boundary, and build the header.

    Args:
        entries: tensors in file order.
        align: alignment of each entry's data (a power of two dividing 4096).
        metadata: the header's ``__metadata__`` (strings only).

    Raises:
        UsageError: a reserved or duplicate name, or a bad alignment.
    """
    if align < 1 or DATA_START_ALIGN % align:
        raise UsageError(f"alignment {align} must divide {DATA_START_ALIGN}")
    header: dict[str, object] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    placed: list[tuple[Entry, int]] = []
    rel = n_pad = 0
    for e in entries:
        if e.name in header or e.name.startswith(PADDING_PREFIX):
            raise UsageError(f"tensor name {e.name!r} is reserved or repeated in one file")
        pad = -rel % align
        if pad:
            header[f"{PADDING_PREFIX}{n_pad}"] = {"dtype": "U8", "shape": [pad], "data_offsets": [rel, rel + pad]}
            rel += pad
            n_pad += 1
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [rel, rel + e.nbytes]}
        placed.append((e, rel))
        rel += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % DATA_START_ALIGN)
    head = struct.pack("<Q", len(text)) + text
    start = len(head)
    return FileLayout(head, tuple(Placed(e.name, e.dtype, e.shape, e.nbytes, start + r) for e, r in placed), start + rel)


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


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """The header JSON of safetensors file ``path`` and the absolute offset of its byte buffer.

    Raises:
        IntegrityError: the file is too short or its header is not a JSON object.
    """
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise IntegrityError(f"{path}: {len(head)} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > 100 << 20:
            raise IntegrityError(f"{path}: header length {n} is implausible")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IntegrityError(f"{path}: header is not valid JSON: {e}") from None
    if len(raw) != n or not isinstance(header, dict):
        raise IntegrityError(f"{path}: header truncated or not a JSON object")
    return header, 8 + n
