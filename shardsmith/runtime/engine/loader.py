"""Where one rank's weights come from: a pack directory, or an unsplit checkpoint sliced at start-up.

Both sources present the same :class:`RankWeights` interface, so the model loader does not care:

=====================  ===================================  ======================================
source                 dense()                              banks()
=====================  ===================================  ======================================
pack (default)         mmap views of ``dense-*.safetensors``  mmap views of ``experts-<layer>``
                       (:func:`shardsmith.pack.reader.open_rank`)   bank arrays
``--from-checkpoint``  each shard cut from the mmap'd       each layer's bank assembled from the
                       source (copies; only its pages read) experts' shards (one copy per bank)
=====================  ===================================  ======================================

The checkpoint path is the baseline a pack must beat: it resolves the same plan
(:func:`shardsmith.plans.plan_checkpoint`) and slices with the same code as ``split``
(:mod:`shardsmith.pack.banks`).

Example:
    >>> w = load_rank_weights("ckpt/", rank=0, world_size=2, from_checkpoint=True)  # doctest: +SKIP
    >>> w.dense()["model.embed_tokens.weight"].shape  # doctest: +SKIP
    torch.Size([24576, 576])
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from shardsmith.checkpoint import open_checkpoint
from shardsmith.errors import RuntimeLoadError
from shardsmith.plans import plan_checkpoint
from shardsmith.plans.resolve import ResolvedPlan
from shardsmith.pack.banks import bank_specs, cut
from shardsmith.dtypes import typed_view


@runtime_checkable
class RankWeights(Protocol):
    """One rank's tensors and the plan that shaped them.

    Attributes:
        rank, world_size: the rank these weights are for.
        root: directory with ``config.json`` and the tokenizer files.
        config: parsed ``config.json``.
        plan: the resolved plan (rank-local shapes via ``plan.tensors[name].local_shape(rank)``).
    """

    rank: int
    world_size: int
    root: Path
    config: dict
    plan: ResolvedPlan

    def dense(self) -> dict[str, torch.Tensor]:
        """Every non-expert tensor: source name -> rank-local tensor (scales included)."""
        ...

    def banks(self) -> dict[str, dict[str, torch.Tensor]]:
        """Expert banks: layer key (``model.layers.3``) -> array name (``gate_up``, ...) -> ``[E, ...]``."""
        ...


class CheckpointRankWeights:
    """:class:`RankWeights` sliced from an unsplit Hugging Face checkpoint at start-up.

    Args:
        ckpt_dir: the checkpoint directory; rank, world_size: the rank to cut for.
        align: the ``--align`` unit the plan is resolved with (1: none).

    Raises:
        SourceError: malformed checkpoint (from :func:`~shardsmith.checkpoint.open_checkpoint`).
        PlanError: the checkpoint cannot be planned at ``world_size``.
        RuntimeLoadError: ``rank`` outside ``[0, world_size)``.
    """

    def __init__(self, ckpt_dir: str | os.PathLike, rank: int, world_size: int, align: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise RuntimeLoadError(f"rank {rank} outside [0, world_size={world_size})")
        self.ckpt = open_checkpoint(ckpt_dir)
        self.rank, self.world_size = rank, world_size
        self.root = Path(ckpt_dir)
        self.config = self.ckpt.config
        self.plan = plan_checkpoint(self.ckpt, world_size, align=align)

    def dense(self) -> dict[str, torch.Tensor]:
        """Every non-expert tensor's shard, cut from the memory-mapped source (one copy each)."""
        out = {}
        for name, tp in self.plan.tensors.items():
            if tp.bank is None:
                buf = torch.empty(tp.local_nbytes(self.rank), dtype=torch.uint8)
                buf.numpy()[:] = cut(self.ckpt.raw(self.ckpt.info(name)), tp, self.rank)
                out[name] = typed_view(buf, tp.dtype, tp.local_shape(self.rank))
        return out

    def banks(self) -> dict[str, dict[str, torch.Tensor]]:
        """Each MoE layer's bank arrays, assembled slot by slot in the pack layout."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for layer, specs in bank_specs(self.plan, self.rank).items():
            for spec in specs:
                buf = torch.empty(spec.nbytes, dtype=torch.uint8)  # torch allocations are 64-byte aligned
                raw = buf.numpy()
                for (expert, segment), name in spec.members.items():
                    off = spec.slot_offset(expert, segment)
                    raw[off: off + spec.slot_nbytes] = cut(self.ckpt.raw(self.ckpt.info(name)), self.plan.tensors[name], self.rank)
                out.setdefault(layer, {})[spec.name] = typed_view(buf, spec.dtype, spec.shape)
        return out

    @property
    def bytes_per_rank(self) -> int:
        """Bytes of this rank's tensors (dense and banks)."""
        return sum(self.plan.rank_bytes(self.rank).values())


def load_rank_weights(path: str | os.PathLike, *, rank: int, world_size: int, from_checkpoint: bool = False,
                      verify: bool = True, verify_hashes: bool = False, expect_digest: str | None = None) -> RankWeights:
    """Open rank ``rank``'s weights from a pack (default) or an unsplit checkpoint.

    Args:
        path: the pack's output directory (``OUT``, holding ``pack.yaml`` and ``rank-R-of-N/``), or
            with ``from_checkpoint`` the checkpoint directory.
        rank, world_size: as launched; a pack made for another world size is refused.
        from_checkpoint: slice the source at start-up instead of reading a pack.
        verify: hash every weight file (XXH3-128, the manifest's digests) as it is first read:
            dense files when mapped, host banks while they are read (packs only; the default).
        verify_hashes: hash every file now, before returning (packs only).
        expect_digest: the pack's root digest as ``split`` printed it; another pack is refused.

    Returns:
        a :class:`RankWeights`.

    Raises:
        RuntimeLoadError: wrong world size or rank, not a pack (with the hint to use
            ``--from-checkpoint``).
        ManifestError, IntegrityError: from the pack reader (a damaged manifest, a link or a path
            outside the pack, a file whose bytes differ, another root digest).
        SourceError, PlanError: from the checkpoint path.
    """
    path = Path(path)
    if from_checkpoint:
        return CheckpointRankWeights(path, rank, world_size)
    if not (path / "pack.yaml").is_file():
        hint = " (it looks like a checkpoint: pass --from-checkpoint)" if (path / "config.json").is_file() else ""
        raise RuntimeLoadError(f"{path}: not a shardsmith pack, no pack.yaml{hint}")
    from shardsmith.pack.reader import open_rank

    weights = open_rank(path, rank, world_size, verify=verify or verify_hashes, verify_hashes=verify_hashes,
                        expect_digest=expect_digest)
    if weights.world_size != world_size or weights.rank != rank:
        raise RuntimeLoadError(f"{path}: pack rank {weights.rank} of {weights.world_size} opened for rank {rank} "
                               f"of world_size={world_size}")
    return weights
