"""Pack manifests: names, self-hashes, YAML input/output and the files copied beside the weights.

The schema is ``manifests/README.md`` (format version 1). A manifest's own hash is XXH3-128 (hex)
of ``json.dumps(doc_without_the_key, sort_keys=True, separators=(",", ":"))``, so reformatting the
YAML keeps it while editing any value breaks it.

Copied files (decided here, listed in ``pack.yaml``'s ``copied_files``): every top-level file of
the checkpoint whose name matches :data:`COPY_PATTERNS` (config, generation config, tokenizer
files, chat templates, ``*.jinja``, remote-code ``*.py`` that ``auto_map`` may name, README and
LICENSE), plus the ``inference/`` and ``encoding/`` trees, except weights and their index, the
``.safetensors.json`` header stand-ins and hidden files. Other subdirectories are not copied.
"""

from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path

import xxhash
import yaml

from shardsmith.errors import ManifestError

FORMAT = "shardsmith-pack"
FORMAT_VERSION = 1
PACK_MANIFEST = "pack.yaml"
PLAN_FILE = "plan.json"
RANK_MANIFEST = "manifest.yaml"
HASH_KEY = "manifest_xxh3_128"
DENSE_ALIGN = 64
BANK_ALIGN = 4096

COPY_PATTERNS = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken", "*.py", "*.md",
                 "tokenizer*", "chat_template*", "LICENSE*", "NOTICE*")
COPY_DIRS = ("inference", "encoding")
NOT_COPIED = ("*.safetensors", "*.safetensors.json", "*.safetensors.index.json", "*.bin", "*.bin.index.json",
              "*.pt", "*.pth", "*.gguf", "*.ckpt", "*.h5", "*.msgpack", "*.onnx", PACK_MANIFEST, PLAN_FILE)


def rank_dir(rank: int, world_size: int) -> str:
    """The directory name of rank ``rank``: ``rank-<r>-of-<N>``."""
    return f"rank-{rank}-of-{world_size}"


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
        ManifestError: missing, unreadable or not a mapping.
    """
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        doc = yaml.load(path.read_text(), Loader=loader)
    except FileNotFoundError:
        raise ManifestError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ManifestError(f"{path}: cannot parse: {type(e).__name__}: {e}") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{path}: not a YAML mapping")
    return doc


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
