"""shardsmith: split Hugging Face MoE checkpoints into per-rank tensor-parallel packs.

Public entry points live in submodules: :mod:`shardsmith.checkpoint` (read and validate a
checkpoint), :mod:`shardsmith.plans` (tensor-parallel plans as data), :mod:`shardsmith.writer`
(write and verify packs) and :mod:`shardsmith.runtime` (load one rank's pack and serve it).
"""

__version__ = "0.1.0"
