"""The on-disk pack format: names, alignment, self-hashes, YAML I/O, safetensors headers, typed views.

The schema is ``manifests/README.md`` (format version 1). A manifest's own hash is XXH3-128 (hex)
of ``json.dumps(doc_without_the_key, sort_keys=True, separators=(",", ":"))``, so reformatting the
YAML keeps it while editing any value breaks it.

Copied files (decided here, listed in ``pack.yaml``'s ``copied_files``): every top-level file of
the checkpoint whose name matches :data:`COPY_PATTERNS` (config, generation config, tokenizer
files, chat templates, ``*.jinja``, remote-code ``*.py`` that ``auto_map`` may name, README and
LICENSE), plus the ``inference/`` and ``encoding/`` trees, except weights and their index, the
``.safetensors.json`` header stand-ins and hidden files. Other subdirectories are not copied.

Weight files are safetensors files (spec: https://github.com/huggingface/safetensors, 8-byte
little-endian header length ``N``, ``N`` bytes of header JSON, the byte buffer) with the two legal
additions of ``manifests/README.md``: the header JSON is space-padded so the buffer starts at a
multiple of 4096, and each entry starts at a multiple of its file's alignment, the gaps covered by
``__padding__.<k>`` ``U8`` entries. :func:`layout_file` fixes every offset from the entries alone;
:func:`read_header` reads one back (:func:`shardsmith.dtypes.typed_view` views its bytes as a tensor).
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash
import yaml

from shardsmith.errors import IntegrityError, ManifestError, UsageError
from shardsmith.strict_parse import DuplicateKeyError, loads_yaml, parse_header

FORMAT = "shardsmith-pack"
FORMAT_VERSION = 1
PACK_MANIFEST = "pack.yaml"
PLAN_FILE = "plan.json"
RANK_MANIFEST = "manifest.yaml"
HASH_KEY = "manifest_xxh3_128"
DENSE_ALIGN = 64
BANK_ALIGN = 4096
DATA_START_ALIGN = 4096
PADDING_PREFIX = "__padding__."
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit

COPY_PATTERNS = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken", "*.py", "*.md",
                 "tokenizer*", "chat_template*", "LICENSE*", "NOTICE*")
COPY_DIRS = ("inference", "encoding")
NOT_COPIED = ("*.safetensors", "*.safetensors.json", "*.safetensors.index.json", "*.bin", "*.bin.index.json",
              "*.pt", "*.pth", "*.gguf", "*.ckpt", "*.h5", "*.msgpack", "*.onnx", PACK_MANIFEST, PLAN_FILE)


def rank_dir(rank: int, world_size: int) -> str:
    """The directory name of rank ``rank``: ``rank-<r>-of-<N>``."""
    return f"rank-{rank}-of-{world_size}"


def pack_id_of(plan_hash: str, source_hashes: list[str] | tuple[str, ...]) -> str:
    """XXH3-128 hex of the plan file's hash and the source shard hashes, newline-joined in order."""
    return xxhash.xxh3_128("\n".join([plan_hash, *source_hashes]).encode()).hexdigest()


def root_digest(pack_yaml: bytes) -> str:
    """The pack's root digest: XXH3-128 hex of ``pack.yaml``'s bytes.

    ``pack.yaml`` pins ``plan.json``, every copied file and every rank manifest by hash, and each
    rank manifest pins its weight files, so this one value pins every byte of the pack. ``split``
    prints it; ``verify --expect`` and ``serve/generate --expect-digest`` check it.
    """
    return xxhash.xxh3_128(pack_yaml).hexdigest()


def parse_digest(text: str, option: str) -> str:
    """``text`` as a root digest (:func:`root_digest`: 32 hex digits, any case, spaces around ignored).

    Raises:
        UsageError: anything else, naming ``option`` (a typo is not a damaged pack).
    """
    value = text.strip().lower()
    if len(value) != 32 or any(c not in "0123456789abcdef" for c in value):
        raise UsageError(f"{option} takes the root digest split printed (32 hex digits), got {text!r}")
    return value


def self_hash(doc: dict) -> str:
    """XXH3-128 hex of ``doc`` without :data:`HASH_KEY`, canonically JSON-encoded."""
    body = {k: v for k, v in doc.items() if k != HASH_KEY}
    return xxhash.xxh3_128(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def stamp(doc: dict) -> dict:
    """``doc`` with :data:`HASH_KEY` set to its own hash (added last)."""
    body = {k: v for k, v in doc.items() if k != HASH_KEY}
    body[HASH_KEY] = self_hash(body)
    return body


class _Dumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):  # type: ignore[misc]
    """Block style, except lists of numbers (shapes) on one line: ``shape: [8192, 1024]``."""


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flow = bool(data) and all(isinstance(x, int) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def dump_yaml(doc: dict) -> str:
    """``doc`` as YAML, keys in insertion order, shapes in flow style."""
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def load_yaml(path: Path) -> dict:
    """Parse the YAML mapping at ``path``.

    Raises:
        ManifestError: missing, unreadable, not a mapping, or a key written twice in one mapping.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ManifestError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path}: cannot read: {type(e).__name__}: {e}") from None
    return parse_yaml(text, str(path))


def parse_yaml(text: str, where: str) -> dict:
    """Parse YAML ``text`` (named ``where`` in errors) into a mapping of plain JSON values.

    Only mappings with string keys, lists, strings, integers, finite floats, booleans and null are
    accepted: the self-hash is defined over JSON, so a ``!!binary``, ``!!set`` or date value
    (``format: 2024-01-01``) is damage, named with its field.

    Raises:
        ManifestError: unparsable, not a mapping, a key written twice in one mapping (named, with its
            line), or a value of another type.
    """
    try:
        doc = loads_yaml(text)
    except DuplicateKeyError as e:
        raise ManifestError(f"{where}: {e}") from None
    except (yaml.YAMLError, ValueError, TypeError, RecursionError) as e:
        raise ManifestError(f"{where}: cannot parse: {type(e).__name__}: {e}") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: not a YAML mapping")
    _check_plain(doc, where, "")
    return doc


def _check_plain(obj: object, where: str, field: str, depth: int = 0) -> None:
    if depth > 32:
        raise ManifestError(f"{where}: field {field or '<root>'}: nested deeper than 32 levels")
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise ManifestError(f"{where}: field {field or '<root>'}: key {k!r} is not a string")
            _check_plain(v, where, f"{field}.{k}" if field else k, depth + 1)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _check_plain(v, where, f"{field}[{i}]", depth + 1)
    elif isinstance(obj, float) and not math.isfinite(obj):
        raise ManifestError(f"{where}: field {field}: {obj!r} is not a finite number")
    elif obj is not None and not isinstance(obj, (str, int, float, bool)):
        raise ManifestError(f"{where}: field {field}: a YAML {type(obj).__name__} value ({obj!r:.60}); "
                            f"manifests hold only strings, numbers, booleans, null, lists and mappings")


def check_identity(doc: dict, where: str) -> list[str]:
    """Problems with ``doc``'s format, version and own hash (empty when all hold)."""
    problems = []
    if doc.get("format") != FORMAT:
        problems.append(f"{where}: format expected {FORMAT!r}, found {doc.get('format')!r}")
    if doc.get("format_version") != FORMAT_VERSION:
        problems.append(f"{where}: format_version expected {FORMAT_VERSION}, found {doc.get('format_version')!r}")
    if doc.get(HASH_KEY) != self_hash(doc):
        problems.append(f"{where}: own hash ({HASH_KEY}) expected {self_hash(doc)}, found {doc.get(HASH_KEY)} "
                        f"(the manifest was edited or damaged)")
    return problems


def hash_file(path: Path, *, chunk: int = 8 << 20) -> tuple[int, str]:
    """``(bytes, XXH3-128 hex)`` of the file at ``path``, streamed in ``chunk``-byte reads."""
    h = xxhash.xxh3_128()
    n = 0
    buf = bytearray(chunk)
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while k := fh.readinto(buf):
            h.update(mv[:k])
            n += k
    return n, h.hexdigest()


def files_to_copy(root: Path) -> list[str]:
    """Relative paths (POSIX) of the non-weight files of checkpoint ``root`` that a pack carries."""

    def wanted(name: str) -> bool:
        return not name.startswith(".") and not any(fnmatch.fnmatch(name, p) for p in NOT_COPIED)

    out = [p.name for p in sorted(root.iterdir()) if p.is_file() and wanted(p.name)
           and any(fnmatch.fnmatch(p.name, pat) for pat in COPY_PATTERNS)]
    for d in COPY_DIRS:
        base = root / d
        if base.is_dir():
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames[:] = sorted(x for x in dirnames if not x.startswith(".") and x != "__pycache__")
                for f in sorted(filenames):
                    if wanted(f):
                        out.append((Path(dirpath) / f).relative_to(root).as_posix())
    return out


# ------------------------------------------------------------------ safetensors files


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of a weight file, declared before any data is written.

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
        if n > MAX_HEADER_BYTES:
            raise IntegrityError(f"{path}: header length {n} is implausible")
        raw = fh.read(n)
    try:
        header, repeats = parse_header(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise IntegrityError(f"{path}: header is not valid JSON: {e}") from None
    if repeats:
        raise IntegrityError(f"{path}: {DuplicateKeyError([(k, None) for k in repeats])}")
    if len(raw) != n or not isinstance(header, dict):
        raise IntegrityError(f"{path}: header truncated or not a JSON object")
    return header, 8 + n
