"""The pack format: the one place that knows how a pack lies on disk.

================  ==================================================================
module            contents
================  ==================================================================
``format``        file names, alignment, self-hashes, YAML I/O, the files copied beside
``reader``        :func:`open_pack`, :func:`open_rank`: one rank's tensors, memory-mapped
================  ==================================================================

Both ``writer/`` (which writes packs) and ``runtime/`` (which loads them) import this package;
it imports neither.
"""

from shardsmith.pack.reader import Pack, RankPack, open_pack, open_rank

__all__ = ["Pack", "RankPack", "open_pack", "open_rank"]
