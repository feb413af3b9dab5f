"""Where ``split`` may write: refuse, before any write, an ``OUT`` that would destroy data.

``split`` builds ``OUT.partial/`` beside ``OUT`` and renames it over ``OUT``, removing what was
there. Rules (symlinks resolved before comparing paths):

- ``OUT`` and ``OUT.partial`` must not be the checkpoint directory, contain it, lie inside it, or
  contain a source shard (Hugging Face caches link shards into ``../../blobs``);
- an existing ``OUT`` must be a directory, not a symlink; ``force`` replaces it only when it is
  empty, a pack (holds ``pack.yaml``) or a partial split of ours;
- an existing ``OUT.partial`` (restarted or resumed) must be a partial split of ours: empty, or
  holding ``journal.jsonl``, ``pack.yaml`` or only ``rank-<r>-of-<N>`` directories.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import UsageError
from .journal import JOURNAL
from shardsmith.pack.format import PACK_MANIFEST

_RANK_DIR = re.compile(r"rank-\d+-of-\d+")


def partial_dir(out: Path) -> Path:
    """``OUT.partial``, the working directory of a split into ``out``."""
    return out.with_name(out.name + ".partial")


def is_ours(d: Path) -> bool:
    """True when directory ``d`` is empty, a pack, or a partial split written by shardsmith."""
    names = {p.name: p for p in d.iterdir()}
    if not names or PACK_MANIFEST in names or JOURNAL in names:
        return True
    return all(_RANK_DIR.fullmatch(n) and p.is_dir() and not p.is_symlink() for n, p in names.items())


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
