"""Typed, frozen records of ``pack.yaml`` and ``rank-R-of-N/manifest.yaml``, parsed with a strict schema.

Every manifest is read through :func:`parse_pack_manifest` or :func:`parse_rank_manifest`; no other
module reads a manifest's raw mapping. The schema is ``manifests/README.md``: each key required
unless said otherwise, no key beyond those, integers in range (booleans are not integers), hashes
32 lowercase hex digits. A damaged manifest (a key renamed by a bit flip, a truncated file, a
value of the wrong type, a huge ``world_size``) is a :class:`~shardsmith.errors.ManifestError`
naming the file and the field, never a ``KeyError`` later.

Example:
    >>> doc = {"path": "config.json", "bytes": 10, "xxh3_128": "0" * 32}
    >>> parse_copied_file(doc, "pack.yaml", "copied_files[0]").path
    'config.json'
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from shardsmith.dtypes import DTYPES
from shardsmith.errors import ManifestError

MAX_WORLD_SIZE = 4096  # ranks in one pack; larger values are damage, not a deployment
MAX_BYTES = 1 << 50  # one file or tensor (1 PiB)
HEX128 = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """One tensor or bank array of a weight file (``files[].tensors[]``).

    Attributes:
        name; dtype (safetensors); shape (header shape, elements); offset (absolute, bytes, in the
        file); bytes; xxh3_128 (of the tensor's bytes).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    bytes: int
    xxh3_128: str


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One weight file of a rank (``files[]``).

    Attributes:
        path: name relative to the rank directory; kind: ``dense`` or ``bank``; layer: the bank's
        layer key (``None`` for dense); bytes; xxh3_128 (whole file); tensors, in file order.
    """

    path: str
    kind: str
    layer: str | None
    bytes: int
    xxh3_128: str
    tensors: tuple[TensorRecord, ...]


@dataclass(frozen=True, slots=True)
class RankManifest:
    """``rank-R-of-N/manifest.yaml``."""

    format: str
    format_version: int
    rank: int
    world_size: int
    pack_id: str
    files: tuple[FileRecord, ...]
    manifest_xxh3_128: str


@dataclass(frozen=True, slots=True)
class HashedFile:
    """A file named with its size and hash: a copied file (``path``) or a source shard (``name``).

    Attributes:
        path: relative POSIX path (copied files) or the source shard's name; bytes; xxh3_128.
    """

    path: str
    bytes: int
    xxh3_128: str


@dataclass(frozen=True, slots=True)
class PlanRecord:
    """``pack.yaml``'s ``plan``: the plan file, its size and hash, and a summary."""

    file: str
    bytes: int
    xxh3_128: str
    family: str
    align: int
    notes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RankEntry:
    """``pack.yaml``'s ``ranks[]``: ``manifest_xxh3_128`` is ``None`` for a rank this split did not write."""

    rank: int
    dir: str
    manifest_xxh3_128: str | None


@dataclass(frozen=True, slots=True)
class PackManifest:
    """``pack.yaml``. ``source_files`` are the source shards (``path`` holds each shard's ``name``)."""

    format: str
    format_version: int
    world_size: int
    created_by: str
    architecture: str
    family: str
    source_files: tuple[HashedFile, ...]
    plan: PlanRecord
    copied_files: tuple[HashedFile, ...]
    ranks: tuple[RankEntry, ...]
    ranks_written: tuple[int, ...]
    pack_id: str
    manifest_xxh3_128: str


class _Obj:
    """Field access on one mapping of a manifest, with the schema's errors (file and field named)."""

    def __init__(self, doc: Any, where: str, field: str) -> None:
        self.where, self.field = where, field
        if not isinstance(doc, dict):
            self._fail("", f"expected a mapping, found {_show(doc)}")
        self.doc, self.seen = doc, set()

    def _name(self, key: str) -> str:
        return f"{self.field}.{key}" if self.field and key else (self.field or key or "<root>")

    def _fail(self, key: str, why: str) -> None:
        raise ManifestError(f"{self.where}: field {self._name(key)}: {why}")

    def get(self, key: str) -> Any:
        self.seen.add(key)
        if key not in self.doc:
            self._fail(key, "missing")
        return self.doc[key]

    def str(self, key: str, *, pattern: re.Pattern | None = None, nullable: bool = False) -> str | None:
        v = self.get(key)
        if v is None and nullable:
            return None
        if not isinstance(v, str):
            self._fail(key, f"expected a string, found {_show(v)}")
        if pattern is not None and not pattern.fullmatch(v):
            self._fail(key, f"{v!r:.80} is not {pattern.pattern}")
        return v

    def int(self, key: str, lo: int, hi: int, v: Any = None, *, value_given: bool = False) -> int:
        v = v if value_given else self.get(key)
        if not isinstance(v, int) or isinstance(v, bool):
            self._fail(key, f"expected an integer, found {_show(v)}")
        if not lo <= v <= hi:
            self._fail(key, f"{v} outside [{lo}, {hi}]")
        return v

    def list(self, key: str) -> list[tuple[Any, str]]:
        v = self.get(key)
        if not isinstance(v, list):
            self._fail(key, f"expected a list, found {_show(v)}")
        return [(x, f"{self._name(key)}[{i}]") for i, x in enumerate(v)]

    def obj(self, key: str) -> "_Obj":
        return _Obj(self.get(key), self.where, self._name(key))

    def done(self) -> None:
        extra = sorted(k for k in self.doc if k not in self.seen)
        if extra:
            self._fail("", f"unknown key{'s' if len(extra) > 1 else ''} {', '.join(map(repr, extra))} "
                           f"(expected only {', '.join(sorted(self.seen))})")


def _show(v: Any) -> str:
    return f"{type(v).__name__} {v!r:.60}"


def parse_tensor(doc: Any, where: str, field: str) -> TensorRecord:
    """One ``files[].tensors[]`` entry (see :func:`record_problems` for its ``bytes``)."""
    o = _Obj(doc, where, field)
    name = o.str("name")
    dtype = o.str("dtype")
    if dtype not in DTYPES:
        o._fail("dtype", f"{dtype!r:.40} is not a safetensors dtype ({', '.join(sorted(DTYPES))})")
    shape = tuple(o.int("shape", 0, MAX_BYTES, x, value_given=True) for x, _ in o.list("shape"))
    if len(shape) > 8:
        o._fail("shape", f"{len(shape)} dims, at most 8")
    offset, nbytes = o.int("offset", 0, MAX_BYTES), o.int("bytes", 0, MAX_BYTES)
    t = TensorRecord(name, dtype, shape, offset, nbytes, o.str("xxh3_128", pattern=HEX128))
    o.done()
    return t


def parse_file(doc: Any, where: str, field: str) -> FileRecord:
    """One ``files[]`` entry: ``layer`` present for a bank, absent for a dense file."""
    o = _Obj(doc, where, field)
    path, kind = o.str("path"), o.str("kind")
    if kind not in ("dense", "bank"):
        o._fail("kind", f"{kind!r:.40} is neither 'dense' nor 'bank'")
    layer = o.str("layer") if kind == "bank" else None
    size, digest = o.int("bytes", 0, MAX_BYTES), o.str("xxh3_128", pattern=HEX128)
    tensors = tuple(parse_tensor(t, where, f) for t, f in o.list("tensors"))
    o.done()
    return FileRecord(path, kind, layer, size, digest, tensors)


def record_problems(rec: FileRecord, where: str, field: str) -> list[str]:
    """Values of a parsed file record that contradict each other: a tensor whose ``bytes`` is not
    what its dtype and shape need, or that ends past the file."""
    out = []
    for i, t in enumerate(rec.tensors):
        need = DTYPES[t.dtype].nbytes(t.shape)
        if need != t.bytes:
            out.append(f"{where}: field {field}.tensors[{i}].bytes: {t.bytes}, but {t.dtype}{list(t.shape)} is {need} bytes")
        if t.offset + t.bytes > rec.bytes:
            out.append(f"{where}: field {field}.tensors[{i}]: tensor {t.name!r} ends at byte {t.offset + t.bytes}, "
                       f"past the file's {rec.bytes} bytes")
    return out


def parse_copied_file(doc: Any, where: str, field: str, *, key: str = "path") -> HashedFile:
    """A ``copied_files[]`` entry (``key="path"``) or a ``source.files[]`` entry (``key="name"``)."""
    o = _Obj(doc, where, field)
    f = HashedFile(o.str(key), o.int("bytes", 0, MAX_BYTES), o.str("xxh3_128", pattern=HEX128))
    o.done()
    return f


def parse_rank_manifest(doc: Any, where: str) -> RankManifest:
    """``manifest.yaml`` of one rank, parsed (identity values are checked by the caller).

    Raises:
        ManifestError: naming ``where`` and the first field that breaks the schema.
    """
    o = _Obj(doc, where, "")
    m = RankManifest(o.str("format"), o.int("format_version", 0, 1 << 31), o.int("rank", 0, MAX_WORLD_SIZE - 1),
                     o.int("world_size", 1, MAX_WORLD_SIZE), o.str("pack_id", pattern=HEX128),
                     tuple(parse_file(f, where, fld) for f, fld in o.list("files")),
                     o.str("manifest_xxh3_128", pattern=HEX128))
    o.done()
    return m


def parse_pack_manifest(doc: Any, where: str) -> PackManifest:
    """``pack.yaml``, parsed, with the fields that must agree with each other checked.

    ``ranks`` holds one entry per rank of the world, ``ranks[i].rank == i`` and
    ``ranks[i].dir == rank-i-of-N``; ``ranks_written`` is exactly the ranks whose manifest hash is
    recorded; ``plan.file`` is ``plan.json``.

    Raises:
        ManifestError: naming ``where`` and the first field that breaks the schema or contradicts another.
    """
    from shardsmith.pack.format import PLAN_FILE, pack_id_of, rank_dir

    o = _Obj(doc, where, "")
    fmt, version = o.str("format"), o.int("format_version", 0, 1 << 31)
    world = o.int("world_size", 1, MAX_WORLD_SIZE)
    created_by = o.str("created_by")
    src = o.obj("source")
    arch, family = src.str("architecture"), src.str("family")
    sources = tuple(parse_copied_file(f, where, fld, key="name") for f, fld in src.list("files"))
    src.done()
    p = o.obj("plan")
    plan = PlanRecord(p.str("file"), p.int("bytes", 0, MAX_BYTES), p.str("xxh3_128", pattern=HEX128), p.str("family"),
                      p.int("align", 1, 1 << 30), tuple(_strs(p, "notes")))
    p.done()
    if plan.file != PLAN_FILE:
        p._fail("file", f"{plan.file!r:.80}, but a pack's plan is always {PLAN_FILE!r}")
    copied = tuple(parse_copied_file(f, where, fld) for f, fld in o.list("copied_files"))
    ranks = []
    for i, (r, fld) in enumerate(o.list("ranks")):
        e = _Obj(r, where, fld)
        entry = RankEntry(e.int("rank", 0, MAX_WORLD_SIZE - 1), e.str("dir"),
                          e.str("manifest_xxh3_128", pattern=HEX128, nullable=True))
        e.done()
        if entry.rank != i:
            e._fail("rank", f"{entry.rank}, but it is entry {i} of the list (entry i describes rank i)")
        if entry.dir != rank_dir(i, world):
            e._fail("dir", f"{entry.dir!r:.80}, expected {rank_dir(i, world)!r} (world_size={world})")
        ranks.append(entry)
    if len(ranks) != world:
        o._fail("ranks", f"{len(ranks)} entries, but world_size is {world} (one entry per rank)")
    written = tuple(o.int("ranks_written", 0, world - 1, x, value_given=True) for x, _ in o.list("ranks_written"))
    recorded = tuple(e.rank for e in ranks if e.manifest_xxh3_128 is not None)
    if written != recorded:
        o._fail("ranks_written", f"{list(written)}, but ranks records a manifest hash for ranks {list(recorded)}")
    m = PackManifest(fmt, version, world, created_by, arch, family, sources, plan, copied, tuple(ranks), written,
                     o.str("pack_id", pattern=HEX128), o.str("manifest_xxh3_128", pattern=HEX128))
    o.done()
    want = pack_id_of(plan.xxh3_128, [f.xxh3_128 for f in sources])
    if m.pack_id != want:
        o._fail("pack_id", f"{m.pack_id}, but the plan and source hashes it is made of give {want}")
    return m


def _strs(o: _Obj, key: str) -> list[str]:
    out = []
    for x, fld in o.list(key):
        if not isinstance(x, str):
            raise ManifestError(f"{o.where}: field {fld}: expected a string, found {_show(x)}")
        out.append(x)
    return out
