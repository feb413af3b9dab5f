"""The pack format: the one place that knows how a pack lies on disk.

================  ==================================================================
module            contents
================  ==================================================================
``format``        file names, alignment, self-hashes, YAML I/O, the files copied beside,
                  safetensors headers, the one typed view of bytes, the root digest
``records``       frozen records of ``pack.yaml`` and rank manifests, strict schema
``banks``         rank cuts, expert-bank arrays, what each rank holds
``coverage``      ``plan.json``'s values and coverage, checked before any arithmetic
``check``         the one rank check (safe paths, no links, manifests, headers, sizes)
``reader``        :func:`open_pack`, :func:`open_rank`: one rank's tensors, memory-mapped
================  ==================================================================

Both ``writer/`` (which writes packs) and ``runtime/`` (which loads them) import this package;
it imports neither.
"""

from shardsmith.pack.reader import Pack, RankPack, open_pack, open_rank

__all__ = ["Pack", "RankPack", "open_pack", "open_rank"]
