"""A rank's compile caches, kept per pack under ``$SHARDSMITH_CACHE/compile``, so a second start compiles nothing.

A server's warm-up compiles: TorchInductor graphs of the ``torch.compile``'d decode pieces (its FX
graph, AOTAutograd and autotune caches) and Triton kernels (ours and the ones inductor writes).
Both libraries keep on-disk caches keyed by content, in per-user temporary folders by default;
:func:`open_cache` gives them one folder per pack, rank and key instead, records what it was made
for, and checks it before any use::

    $SHARDSMITH_CACHE/compile/<pack folder>-<path hash>-rank<r>of<N>-<key hash>/
        record.json   the key it was made for; once a warm-up ended, every file's size and XXH3-64
        inductor/     TORCHINDUCTOR_CACHE_DIR
        triton/       TRITON_CACHE_DIR

=============================================  ===================================================
found                                          done (and logged on rank 0)
=============================================  ===================================================
no folder for this key; folders of this pack   a new one; the others are left alone (another
and rank for other keys (pack digest, world    server may use them) and the log names every
size, dtype, device, torch, Triton, Python,    field that differs, old and new value
kernel settings)
a folder with no record yet                    used as it is (a start of the same key still
                                               warming up: the libraries write files whole)
a record that cannot be read, or made for      moved aside, removed and rebuilt, the reason logged
another key
a recorded file missing or whose bytes differ  moved aside, removed and rebuilt, the file named (a
                                               damaged entry could crash a load or a launch)
``TRITON_CACHE_DIR`` or                        not managed: the user's folders are used as set
``TORCHINDUCTOR_CACHE_DIR`` set by the user    (``serve`` and ``warmup`` ask
                                               ``settings.library_cache_folders`` before the ranks start)
=============================================  ===================================================

:meth:`CompileCache.seal` (every rank, once its warm-up ended) records the files; a folder left
holding no compiled file is removed (the CPU path compiles nothing by default). Folders past
:data:`KEEP_FOLDERS` are removed oldest first. Dynamo still traces each piece at start (its
guards are not cached across processes); what a warm cache skips is inductor's code generation,
the C++/PTX compiles and Triton's compiles.

Sources: PyTorch's compile caching recipe
(https://docs.pytorch.org/tutorials/recipes/torch_compile_caching_tutorial.html), Triton's cache
knobs (``triton.knobs.cache``).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

import xxhash

log = logging.getLogger("shardsmith.runtime")

RECORD = "record.json"
KEEP_FOLDERS = 16  # compile folders kept under $SHARDSMITH_CACHE/compile (least recently used go first)


@dataclass(frozen=True, slots=True)
class CacheKey:
    """What a compile cache is valid for. Attributes: pack (the pack's root digest, or a digest of a
    checkpoint's ``config.json`` and weight files' names, sizes and times), rank, world_size, dtype
    (``torch.bfloat16``), device (the GPU's name and capability, or the CPU's architecture and vector
    ISA), torch, triton, python (versions), kernels (the ``SHARDSMITH_KERNELS`` items, resolved)."""

    pack: str
    rank: int
    world_size: int
    dtype: str
    device: str
    torch: str
    triton: str
    python: str
    kernels: str


def pack_identity(path: Path, *, from_checkpoint: bool = False) -> str:
    """The digest that names ``path``'s weights: a pack's root digest (XXH3-128 of ``pack.yaml``), or for a
    checkpoint XXH3-128 over ``config.json``'s bytes and each ``*.safetensors`` file's name, size and mtime."""
    if not from_checkpoint:
        from shardsmith.pack.format import PACK_MANIFEST, root_digest

        return root_digest((path / PACK_MANIFEST).read_bytes())
    h = xxhash.xxh3_128((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def device_label(device: torch.device) -> str:
    """``NVIDIA H200 sm_90`` for a GPU; ``cpu x86_64 AVX512`` for the CPU (what inductor's C++ code targets)."""
    import torch

    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"
    return f"cpu {platform.machine()} {torch.backends.cpu.get_cpu_capability()}"


def make_key(path: Path, *, from_checkpoint: bool, rank: int, world_size: int, dtype: torch.dtype,
             device: torch.device) -> CacheKey:
    """The :class:`CacheKey` of this process's start (versions and settings read here)."""
    import torch

    from shardsmith import settings

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    kernels = settings.items(settings.current(), settings.KERNELS)
    kernels["compile_rows"] = settings.current().compile_rows.value  # what the compiled graphs are keyed by
    return CacheKey(pack=pack_identity(path, from_checkpoint=from_checkpoint), rank=rank, world_size=world_size,
                    dtype=str(dtype), device=device_label(device), torch=torch.__version__, triton=triton_version,
                    python=platform.python_version(), kernels=",".join(f"{k}={v}" for k, v in sorted(kernels.items())))


def folder_prefix(path: Path, rank: int, world_size: int) -> str:
    """``<pack folder>-<XXH3-64 of its resolved path, 12 hex>-rank<r>of<N>``: what every compile folder of one
    served pack and rank starts with."""
    where = xxhash.xxh3_64(str(path.resolve()).encode()).hexdigest()[:12]
    return f"{path.resolve().name}-{where}-rank{rank}of{world_size}"


def folder_name(path: Path, key: CacheKey) -> str:
    """:func:`folder_prefix` and ``-<XXH3-64 of the key, 8 hex>``: one folder per pack, rank and key, so
    servers of one pack with different keys (dtype, kernel settings) never share or empty one."""
    digest = xxhash.xxh3_64(json.dumps(asdict(key), sort_keys=True).encode()).hexdigest()[:8]
    return f"{folder_prefix(path, key.rank, key.world_size)}-{digest}"


class CompileCache:
    """One rank's compile cache folder, opened by :func:`open_cache`.

    Attributes:
        folder: the folder; key: what it is for; state: ``new``, ``reused`` or ``rebuilt``; why:
        the reason it was rebuilt, or for a new one what this pack's other folders were made for
        ("" when nothing to say); files_at_open: compiled files found; known: the files checked at
        open or recorded at the last seal (path -> (bytes, XXH3-64 hex)), which a seal does not hash again.
    """

    def __init__(self, folder: Path, key: CacheKey, state: str, why: str, files_at_open: int,
                 known: dict[str, tuple[int, str]] | None = None) -> None:
        self.folder, self.key, self.state, self.why, self.files_at_open = folder, key, state, why, files_at_open
        self.known = dict(known or {})

    def files(self) -> dict[str, tuple[int, str]]:
        """Every compiled file: path relative to the folder -> (bytes, XXH3-64 hex). A file in
        :attr:`known` of the same size keeps its hash (the libraries write a file whole, under a name
        made from its content, and never rewrite it); the others are read and hashed."""
        out = {}
        for sub in ("inductor", "triton"):
            for dirpath, _, names in os.walk(self.folder / sub):
                for n in names:
                    p = Path(dirpath) / n
                    rel, size = str(p.relative_to(self.folder)), p.stat().st_size
                    seen = self.known.get(rel)
                    out[rel] = seen if seen is not None and seen[0] == size else (size, _hash(p))
        return out

    def count(self) -> int:
        """How many compiled files the folder holds (nothing read)."""
        return sum(len(names) for sub in ("inductor", "triton") for _, _, names in os.walk(self.folder / sub))

    def seal(self) -> int:
        """Record every compiled file (size and hash) so the next start can check them; remove the
        folder when it holds none. Returns the number of files recorded."""
        files = self.files()
        if not files:
            shutil.rmtree(self.folder, ignore_errors=True)
            return 0
        self.known = files
        _write_record(self.folder, {"key": asdict(self.key), "sealed": time.time(),
                                    "files": {k: list(v) for k, v in sorted(files.items())}})
        added = len(files) - self.files_at_open
        log.info("compile cache %s: %d files sealed (%+d this start)", self.folder, len(files), added)
        return len(files)


def open_cache(root: Path, path: Path, key: CacheKey) -> CompileCache:
    """Open (or make) the compile cache folder for ``key`` under ``root`` and point TorchInductor and
    Triton at it (``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``, overriding what they hold).

    A folder whose record cannot be read, was made for another key, or lists a file that is now
    missing or different is moved aside and removed, then made anew, the reason logged. A folder with
    no record yet is used as it is (a start of the same key still warming up, or one that ended
    before its warm-up did: the libraries write each file whole). Folders of this pack and rank made
    for other keys are left alone; the log says what they were made for.

    Args:
        root: ``$SHARDSMITH_CACHE/compile``; path: the pack (or checkpoint) served; key: :func:`make_key`'s.

    Raises:
        OSError: the folder cannot be made or moved aside (the engine logs it and starts without it).
    """
    folder = root / folder_name(path, key)
    state, why, known = "new", "", {}
    if folder.exists():
        why, known = _stale(folder, key)
        state = "rebuilt" if why else "reused"
        if why:
            aside = folder.with_name(f"{folder.name}.damaged-{os.getpid()}")
            folder.rename(aside)  # a process still using it keeps its open files; new writes go to the new one
            shutil.rmtree(aside, ignore_errors=True)
    else:
        why = _others(root, path, key, folder)
    (folder / "inductor").mkdir(parents=True, exist_ok=True)
    (folder / "triton").mkdir(exist_ok=True)
    os.utime(folder)  # most recently used
    _evict(root, keep=folder)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    cache = CompileCache(folder, key, state, why, 0, known if state == "reused" else None)
    cache.files_at_open = cache.count() if state == "reused" else 0  # _stale hashed the recorded ones already
    if state == "rebuilt":
        log.info("compile cache %s: rebuilt: %s", folder, why)
    else:
        log.info("compile cache %s: %s%s%s", folder, state,
                 f" ({cache.files_at_open} compiled files, checked)" if state == "reused" else "",
                 f"; {why}" if why else "")
    return cache


def _others(root: Path, path: Path, key: CacheKey, folder: Path) -> str:
    """What the other compile folders of this pack and rank were made for, as a reason not to use them."""
    out = []
    for other in sorted(root.glob(folder_prefix(path, key.rank, key.world_size) + "-*")):
        if other == folder or not other.is_dir() or ".damaged-" in other.name:
            continue
        try:
            made = json.loads((other / RECORD).read_text())["key"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out.append(f"{other.name} was made for {_differences(made, key)}: not used")
    return "; ".join(out)


def _stale(folder: Path, key: CacheKey) -> tuple[str, dict[str, tuple[int, str]]]:
    """Why ``folder`` cannot be used for ``key`` ("" when it can), and the recorded files it checked."""
    try:
        record = json.loads((folder / RECORD).read_text())
        made = record["key"]
        files = record.get("files", {})
        if not isinstance(made, dict) or not isinstance(files, dict):
            raise ValueError("not a record")
    except FileNotFoundError:
        return "", {}  # not sealed yet: the libraries' files are whole, or absent
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {RECORD} cannot be read ({type(e).__name__}: {e})", {}
    if diff := _differences(made, key):
        return f"its record was made for {diff}", {}
    checked = {}
    for rel, (size, digest) in files.items():
        p = folder / rel
        if not p.is_file():
            return f"{rel} is missing", {}
        if p.stat().st_size != size or _hash(p) != digest:
            return f"{rel} differs from its record (size or XXH3-64)", {}
        checked[rel] = (int(size), str(digest))
    return "", checked


def _differences(made: dict, key: CacheKey) -> str:
    """``dtype 'torch.float32' (now 'torch.bfloat16'), ...``: each field of ``key`` that ``made`` holds otherwise."""
    return ", ".join(f"{k} {made.get(k)!r} (now {v!r})" for k, v in asdict(key).items() if made.get(k) != v)


def _hash(p: Path) -> str:
    with open(p, "rb") as f:
        return xxhash.xxh3_64(f.read()).hexdigest()


def _write_record(folder: Path, doc: dict) -> None:
    tmp = folder / (RECORD + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, folder / RECORD)


def _evict(root: Path, *, keep: Path) -> None:
    """Remove the least recently used folders under ``root`` beyond :data:`KEEP_FOLDERS` (never ``keep``)."""
    folders = sorted((p for p in root.iterdir() if p.is_dir() and p != keep), key=lambda p: p.stat().st_mtime)
    for old in folders[:max(0, len(folders) + 1 - KEEP_FOLDERS)]:
        log.info("compile cache %s: removed (more than %d folders; least recently used)", old, KEEP_FOLDERS)
        shutil.rmtree(old, ignore_errors=True)
