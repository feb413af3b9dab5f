"""Which ranks a pack directory holds, checked before any rank loads (one node or several).

On one machine the launcher checks every rank; on several machines (``torchrun --nnodes N``) each
node holds only its own ranks (``split --ranks``, or ``export --rank`` then ``import``), checks
those, and the nodes exchange verdicts so that all stop together, naming the rank at fault.
Layout: ``manifests/README.md`` (``rank-<r>-of-<N>/manifest.yaml`` with ``pack_id``, ``rank``,
``world_size``).
"""

from __future__ import annotations

import re
from pathlib import Path

from shardsmith.errors import IntegrityError, ManifestError, ShardsmithError, UsageError
from shardsmith.strict_parse import loads_yaml


def check_local_ranks(path: Path, ranks: list[int], world_size: int) -> None:
    """Refuse, before any process group or load, a pack directory that lacks one of ``ranks`` or
    holds another pack's: each ``rank-<r>-of-<N>/manifest.yaml`` must exist and name this pack's
    ``pack_id`` (``pack.yaml``), ``r`` and ``N``. On several machines each node checks only the
    ranks it runs (under ``torchrun``, its ``RANK``), so a node may hold just its own.

    Raises:
        UsageError: a rank directory is missing (naming the rank and how to give the node its rank).
        IntegrityError: a rank directory of another pack (another ``pack_id``, rank or world size).
        ManifestError: ``pack.yaml`` or a rank manifest does not parse.
    """
    from shardsmith.pack.format import PACK_MANIFEST, RANK_MANIFEST, load_yaml, rank_dir

    pack_id = load_yaml(Path(path) / PACK_MANIFEST).get("pack_id")
    fix = ("give this node its rank: `shardsmith split --ranks R` into this directory, or `shardsmith export "
           "PACK --rank R rank-R.tar.zst` then `shardsmith import rank-R.tar.zst DIR` (README: Several machines)")
    for rank in ranks:
        d = Path(path) / rank_dir(rank, world_size)
        if not (d / RANK_MANIFEST).is_file():
            have = sorted(x.name for x in Path(path).glob(f"rank-*-of-{world_size}") if x.is_dir())
            raise UsageError(f"rank {rank} of {world_size}: {d} is missing (this directory holds "
                             f"{', '.join(have) or 'no rank'}); {fix}")
        manifest = load_yaml(d / RANK_MANIFEST)
        want = {"pack_id": pack_id, "rank": rank, "world_size": world_size}
        bad = [f"{k} expected {v!r}, found {manifest.get(k)!r}" for k, v in want.items() if manifest.get(k) != v]
        if bad:
            raise IntegrityError(f"rank {rank} of {world_size}: {d / RANK_MANIFEST} belongs to another pack "
                                 f"({'; '.join(bad)}); {fix}")


def agree_on_local_ranks(path: Path, rank: int, world_size: int) -> None:
    """:func:`check_local_ranks` for this rank on every node, the verdicts exchanged (a gloo group:
    no device work), so that every node stops, naming each rank that is missing or of another
    pack, instead of the good nodes waiting for a peer that already gave up.

    Raises:
        IntegrityError: some rank holds another pack's rank directory (each such rank named).
        UsageError: some rank's directory is missing (each rank named).
    """
    import torch.distributed as dist

    try:
        check_local_ranks(path, [rank], world_size)
        mine: tuple[str, str] | None = None
    except ShardsmithError as e:
        mine = (type(e).__name__, str(e))
    everyone: list[tuple[str, str] | None] = [None] * world_size
    group = dist.new_group(backend="gloo")
    dist.all_gather_object(everyone, mine, group=group)
    dist.destroy_process_group(group)
    bad = [x for x in everyone if x is not None]
    if bad:
        cls = IntegrityError if any(name == "IntegrityError" for name, _ in bad) else UsageError
        raise cls("\n".join(text for _, text in bad))


RANK_DIR = re.compile(r"rank-(\d+)-of-(\d+)")


def rank_dir_of(path: Path) -> tuple[int, int, Path] | None:
    """``(rank, world_size, pack)`` when ``path`` is a rank directory (``rank-<r>-of-<N>/``, as
    ``manifests/README.md`` lays a pack out) with ``pack.yaml`` or its ``manifest.yaml``; else None."""
    m = RANK_DIR.fullmatch(path.resolve().name)
    if m is None or not ((path / "manifest.yaml").is_file() or (path.resolve().parent / "pack.yaml").is_file()):
        return None
    return int(m.group(1)), int(m.group(2)), path.resolve().parent


def pack_world_size(path: Path, *, tp: int | None, from_checkpoint: bool) -> int:
    """Ranks to start: ``--tp`` for a checkpoint, else ``world_size`` from ``OUT/pack.yaml``.

    Raises:
        UsageError: no ``pack.yaml`` (not a pack), ``--tp`` missing with ``--from-checkpoint``,
            ``--from-checkpoint`` given a pack, or ``--tp`` disagreeing with the pack.
        ManifestError: ``pack.yaml`` is not YAML or has no positive integer ``world_size`` (a damaged
            pack: exit 2, as ``verify``).
    """
    if from_checkpoint:
        if (Path(path) / "pack.yaml").is_file():
            raise UsageError(f"{path} is a pack (it has pack.yaml), not a checkpoint; drop --from-checkpoint "
                             f"(the pack's world_size sets the ranks)")
        if tp is None or tp < 1:
            raise UsageError(f"--from-checkpoint needs --tp N >= 1 (the number of ranks to slice the checkpoint for)"
                             f"{'' if tp is None else f', got {tp}'}")
        return tp
    manifest = Path(path) / "pack.yaml"
    if not manifest.is_file():
        if (where := rank_dir_of(Path(path))) is not None:
            rank, ws, pack = where
            raise UsageError(f"{path} is rank {rank} of {ws} of the pack at {pack}, not a pack: give the pack "
                             f"directory ({pack}; each rank loads its own rank-<r>-of-{ws}/ from it)")
        raise UsageError(f"{path}: no pack.yaml; give a pack written by `shardsmith split`, "
                         f"or a checkpoint with --from-checkpoint --tp N")
    import yaml

    try:
        doc = loads_yaml(manifest.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError, ValueError) as e:  # ValueError: a duplicate key
        raise ManifestError(f"{manifest}: not valid YAML ({e})") from e
    ws = doc.get("world_size") if isinstance(doc, dict) else None
    if not isinstance(ws, int) or ws < 1:  # a damaged pack, as `verify` reports it (exit 2)
        raise ManifestError(f"{manifest}: world_size must be a positive integer, got {ws!r}")
    if tp is not None and tp != ws:
        raise UsageError(f"--tp {tp} does not match the pack's world_size={ws} ({manifest})")
    return ws
