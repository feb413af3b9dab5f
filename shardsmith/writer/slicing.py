"""One rank's shard of a source tensor as a torch tensor, read from the memory-mapped source.

The byte arithmetic (:func:`~shardsmith.pack.banks.cut`, the expert-bank layout
:func:`~shardsmith.pack.banks.bank_specs`) lives in :mod:`shardsmith.pack.banks` so the runtime and
the pack reader need no writer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardsmith.pack.banks import cut

from ..checkpoint import Checkpoint, bytes_to_tensor
from ..plans.resolve import TensorPlan

if TYPE_CHECKING:
    import torch


def rank_tensor(ckpt: Checkpoint, tp: TensorPlan, rank: int) -> "torch.Tensor":
    """Rank ``rank``'s shard of source tensor ``tp.name``, read from the memory-mapped source.

    Only the pages holding the shard are touched. Shape ``tp.local_shape(rank)``, dtype of the
    source (``uint8`` bytes for F4).

    Raises:
        SourceError: header-only checkpoint or unreadable data.
    """
    info = ckpt.info(tp.name)
    data = cut(ckpt.raw(info), tp, rank)
    return bytes_to_tensor(bytearray(data.tobytes()) if data.size else bytearray(), tp.dtype, tp.local_shape(rank))
