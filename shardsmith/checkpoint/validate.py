"""Open a checkpoint directory and validate every shard header eagerly, reporting every problem at once.

Checks (each a :class:`~shardsmith.errors.SourceError` line naming file, tensor, value and rule):
``config.json`` parses and the plan fields it holds are well typed (:mod:`.config`); the index (or
single file) exists; every index entry is a plain relative file name (non-empty, no ``..``, within
the system's name limits) of a regular file inside the directory (Hugging Face cache symlinks into
``../../blobs`` are followed), or of its ``.safetensors.json`` header; headers parse into JSON
objects, with no duplicate names; dtypes are known strings; sizes match dtype x shape (``F4``
counts 4-bit elements); offsets neither overlap nor leave gaps nor pass the end of the file (a
truncated shard names the first tensor past its end); index and headers agree.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from ..dtypes import DTYPES, dtype
from ..errors import SourceError, format_problems
from ..strict_parse import parse_header, parse_json
from .config import config_problems
from .reader import HEADER_SUFFIX, INDEX_NAME, MAX_HEADER_BYTES, SINGLE_NAME, Checkpoint, ShardFile, TensorInfo

def _load_json(path: Path, problems: list[str], what: str) -> dict | None:
    try:
        data, repeats = parse_json(path.read_text())
        problems += [f"{path.name}: duplicate key {k!r} in {what}" for k in repeats]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        problems.append(f"{path.name}: cannot parse {what}: {e}")
        return None
    if not isinstance(data, dict):
        problems.append(f"{path.name}: {what} is not a JSON object")
        return None
    return data


def _load_json_text(text: str, name: str, problems: list[str]) -> object:
    """A safetensors header's JSON (:func:`~shardsmith.strict_parse.parse_header`), each repeated
    tensor name added to ``problems``."""
    header, repeats = parse_header(text)
    problems += [f"{name}: duplicate tensor name {k!r} in header" for k in repeats]
    return header


def _read_header(path: Path, name: str, problems: list[str]) -> tuple[dict | None, int, int, bool]:
    """Return (header, file_size, data_start, header_only) for shard ``name``."""
    if path.name.endswith(HEADER_SUFFIX):
        try:
            header = _load_json_text(path.read_text(), name, problems)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            problems.append(f"{path.name}: cannot parse safetensors header: {e}")
            return None, 0, 0, True
        if not isinstance(header, dict):
            problems.append(f"{path.name}: header is not a JSON object")
            return None, 0, 0, True
        return header, path.stat().st_size, 0, True
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            problems.append(f"{name}: file is {size} bytes, too short for the 8-byte header length")
            return None, size, 0, False
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            problems.append(
                f"{name}: header length {n} is larger than the file allows ({size - 8} bytes after "
                f"the length field)"
            )
            return None, size, 0, False
        if n > MAX_HEADER_BYTES:
            problems.append(f"{name}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
            return None, size, 0, False
        raw = fh.read(n)
    try:
        header = _load_json_text(raw.decode("utf-8"), name, problems)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        problems.append(f"{name}: header is not valid JSON: {e}")
        return None, size, 0, False
    if not isinstance(header, dict):
        problems.append(f"{name}: header is not a JSON object")
        return None, size, 0, False
    return header, size, 8 + n, False


def _check_entries(
    name: str, header: dict, data_start: int, size: int, header_only: bool, problems: list[str]
) -> list[TensorInfo]:
    infos: list[tuple[int, int, TensorInfo]] = []
    for tname, entry in header.items():
        if tname == "__metadata__":
            if not isinstance(entry, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in entry.items()
            ):
                problems.append(f"{name}: __metadata__ must map strings to strings")
            continue
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            problems.append(f"{name}: tensor {tname!r} entry lacks dtype, shape or data_offsets")
            continue
        dt, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
                and 0 <= offs[0] <= offs[1]):
            problems.append(f"{name}: tensor {tname!r} has invalid data_offsets {offs!r}")
            continue
        # a bad dtype or shape is reported, but the entry still counts for the offset checks so
        # that one bad entry does not also show up as a gap or as trailing bytes
        if not isinstance(dt, str):
            problems.append(f"{name}: tensor {tname!r} has dtype {dt!r}, which is not a string (such as \"BF16\")")
        elif dt not in DTYPES:
            problems.append(f"{name}: tensor {tname!r} has unknown dtype {dt!r} (known: {', '.join(sorted(DTYPES))})")
        elif not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
            problems.append(f"{name}: tensor {tname!r} has invalid shape {shape!r}")
        else:
            want = dtype(dt).nbytes(shape)
            if dt == "F4" and shape and shape[-1] % 2:
                problems.append(f"{name}: tensor {tname!r} is F4 with odd last dim {shape[-1]} (two per byte)")
            if offs[1] - offs[0] != want:
                problems.append(
                    f"{name}: tensor {tname!r} {dt}{shape} needs {want} bytes but data_offsets "
                    f"{offs} span {offs[1] - offs[0]}"
                )
        info = TensorInfo(tname, str(dt), tuple(shape) if isinstance(shape, list) else (), name,
                          data_start + offs[0], offs[1] - offs[0])
        infos.append((offs[0], offs[1], info))
    infos.sort(key=lambda x: (x[0], x[1]))
    pos = 0
    for b, e, info in infos:
        if b < pos:
            problems.append(f"{name}: tensor {info.name!r} data [{b}, {e}) overlaps the previous tensor (ends at {pos})")
        elif b > pos:
            problems.append(f"{name}: gap of {b - pos} bytes before tensor {info.name!r} at offset {pos}")
        pos = max(pos, e)
    if not header_only:
        avail = size - data_start
        if pos > avail:
            first = next(i for b, e, i in infos if e > avail)
            problems.append(
                f"{name}: truncated: {avail} data bytes on disk but tensors need {pos}; first tensor "
                f"past the end: {first.name!r} (data [{first.offset - data_start}, "
                f"{first.offset - data_start + first.nbytes}))"
            )
        elif pos < avail:
            problems.append(f"{name}: {avail - pos} trailing bytes after the last tensor")
    return [i for _, _, i in infos]


NAME_MAX = 255  # bytes per path component (Linux NAME_MAX)
PATH_MAX = 4095  # bytes per path (Linux PATH_MAX less the terminating NUL)


def shard_name_problem(name: str) -> str | None:
    """Why index entry ``name`` cannot name a shard file inside the checkpoint directory, or ``None``.

    Rules: non-empty; no NUL byte; relative, with no ``..`` component (a Hugging Face index names
    files beside it, or in subdirectories); every component at most :data:`NAME_MAX` bytes and the
    whole at most :data:`PATH_MAX` bytes of UTF-8.
    """
    if not name or os.path.normpath(name) == ".":
        return f"entry {name!r} names no file (an empty path or only '.' and '/')"
    if "\0" in name:
        return f"entry {name[:60]!r} contains a NUL byte"
    if os.path.isabs(name) or ".." in Path(name).parts:
        return f"entry {name[:80]!r} names a path outside the checkpoint directory (absolute, or with '..')"
    raw = name.encode("utf-8", "surrogatepass")
    if len(raw) > PATH_MAX or any(len(part) > NAME_MAX for part in raw.split(b"/")):
        return (f"entry {name[:60]!r}... ({len(raw)} bytes) is too long for a file name "
                f"(at most {NAME_MAX} bytes per component, {PATH_MAX} in all)")
    return None


def _shard_path(root: Path, name: str, problems: list[str]) -> Path | None:
    why = shard_name_problem(name)
    if why:
        problems.append(f"{INDEX_NAME}: {why}")
        return None
    rel = os.path.normpath(name)
    p = root / rel
    h = root / (rel + HEADER_SUFFIX)
    for cand in (p, h):
        if cand.exists():
            if not cand.resolve().is_file():
                problems.append(f"{name}: listed in {INDEX_NAME} but {cand} is not a regular file")
                return None
            return cand.resolve()  # follows Hugging Face cache symlinks into ../../blobs
    if p.is_symlink():
        problems.append(f"{name}: listed in {INDEX_NAME} but {p} is a broken symlink to {os.readlink(p)}")
        return None
    problems.append(f"{name}: listed in {INDEX_NAME} but neither it nor {name}{HEADER_SUFFIX} exists in {root}")
    return None


def open_checkpoint(root: str | os.PathLike) -> Checkpoint:
    """Open checkpoint directory ``root`` and validate every shard header eagerly.

    Checks: ``config.json`` parses and its plan fields are well typed; the index (or single file)
    exists; every index entry names a regular file inside the directory (symlinks followed); every header parses with no duplicate names;
    dtypes are known; sizes match dtype x shape; offsets neither overlap nor leave gaps nor pass
    the end of the file; every tensor the index lists is in its shard and vice versa.

    Raises:
        SourceError: listing every problem found, sorted.
    """
    root = Path(root)
    if not root.is_dir():
        raise SourceError(f"{root}: not a directory")
    problems: list[str] = []
    cfg_path = root / "config.json"
    config = _load_json(cfg_path, problems, "config.json") if cfg_path.exists() else None
    if config is None and not cfg_path.exists():
        problems.append(f"{root}: no config.json")
    if config is not None:
        problems += config_problems(config)
    inf_path = root / "inference" / "config.json"
    inference_config = _load_json(inf_path, problems, "inference/config.json") if inf_path.exists() else None

    weight_map: dict[str, str] | None = None
    idx_path = root / INDEX_NAME
    if idx_path.exists():
        idx = _load_json(idx_path, problems, INDEX_NAME)
        if idx is not None:
            wm = idx.get("weight_map")
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                problems.append(f"{INDEX_NAME}: weight_map missing or not a mapping of names to files")
            else:
                weight_map = wm
        shard_names = list(dict.fromkeys(weight_map.values())) if weight_map else []
    elif (root / SINGLE_NAME).exists() or (root / (SINGLE_NAME + HEADER_SUFFIX)).exists():
        shard_names = [SINGLE_NAME]
    else:
        hint = (" (it holds pack.yaml: a shardsmith pack, not a Hugging Face checkpoint; split reads the checkpoint "
                "the pack was made from)" if (root / "pack.yaml").is_file() else "")
        problems.append(f"{root}: neither {INDEX_NAME} nor {SINGLE_NAME} found{hint}")
        shard_names = []

    files: dict[str, ShardFile] = {}
    tensors: dict[str, TensorInfo] = {}
    for name in shard_names:
        path = _shard_path(root, name, problems)
        if path is None:
            continue
        header, size, data_start, header_only = _read_header(path, name, problems)
        if header is None:
            continue
        meta = header.get("__metadata__") if isinstance(header.get("__metadata__"), dict) else {}
        files[name] = ShardFile(name, path, size, data_start, header_only, dict(meta or {}))
        for info in _check_entries(name, header, data_start, size, header_only, problems):
            if info.name in tensors:
                problems.append(f"tensor {info.name!r} appears in both {tensors[info.name].file} and {name}")
                continue
            tensors[info.name] = info
    if weight_map is not None:
        for tname, fname in weight_map.items():
            if fname in files and tname not in tensors:
                problems.append(f"{fname}: index lists tensor {tname!r} but the shard's header lacks it")
            elif tname in tensors and tensors[tname].file != fname:
                problems.append(f"tensor {tname!r}: index says {fname}, found in {tensors[tname].file}")
        for tname, info in tensors.items():
            if tname not in weight_map:
                problems.append(f"{info.file}: tensor {tname!r} is not listed in {INDEX_NAME}")
    if problems:
        raise SourceError(format_problems(f"invalid checkpoint {root}", problems), sorted(set(problems)))
    return Checkpoint(root, config or {}, inference_config, files, tensors)
