"""Forge edits of a pack as an attacker would: change manifests or ``plan.json``, then recompute
every hash that the pack itself records, so only evidence outside the hashes can catch the edit.

Used by the fault tests; never by the tool. Hashes and ids follow ``manifests/README.md``.

Example:
    >>> forge(pack, doc=lambda d: d.update(world_size=16777216))  # doctest: +SKIP
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import xxhash
import yaml

from shardsmith.pack.format import PACK_MANIFEST, PLAN_FILE, RANK_MANIFEST, dump_yaml, pack_id_of, stamp


def load(path: Path) -> dict:
    """A manifest as a plain mapping (C loader when available)."""
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def forge(pack: Path, *, plan: Callable[[dict], None] | None = None, rank: Callable[[int, dict], None] | None = None,
          doc: Callable[[dict], None] | None = None) -> None:
    """Apply edits to the pack at ``pack`` and recompute the plan record, ``pack_id``, every rank
    manifest's ``pack_id`` and own hash, their hashes in ``pack.yaml`` and its own hash.

    Args:
        plan: edits ``plan.json``'s parsed object in place; rank: ``rank(r, manifest)`` edits rank
            ``r``'s manifest; doc: edits ``pack.yaml`` (last, after the hashes above are set).
    """
    pj = pack / PLAN_FILE
    if plan is not None:
        d = json.loads(pj.read_bytes())
        plan(d)
        pj.write_bytes(json.dumps(d, separators=(",", ":")).encode())
    data = pj.read_bytes()
    d = load(pack / PACK_MANIFEST)
    d["plan"]["bytes"], d["plan"]["xxh3_128"] = len(data), xxhash.xxh3_128(data).hexdigest()
    d["pack_id"] = pack_id_of(d["plan"]["xxh3_128"], [f["xxh3_128"] for f in d["source"]["files"]])
    for entry in d["ranks"]:
        mp = pack / entry["dir"] / RANK_MANIFEST
        if entry.get("manifest_xxh3_128") is None or not mp.is_file():
            continue
        m = load(mp)
        m["pack_id"] = d["pack_id"]
        if rank is not None:
            rank(entry["rank"], m)
        m = stamp(m)
        mp.write_text(dump_yaml(m))
        entry["manifest_xxh3_128"] = m["manifest_xxh3_128"]
    if doc is not None:
        doc(d)
    (pack / PACK_MANIFEST).write_text(dump_yaml(stamp(d)))
