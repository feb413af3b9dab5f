"""gpt-oss in the runtime: tensor-parallel forward pass from the release checkpoint's names.

======================  ===================================================================
module                  contents
======================  ===================================================================
``config``              :class:`GptOssArgs` from ``config.json``; YaRN cos/sin tables
``attention``           GQA with sinks, sliding/full layers, per-sequence KV slots
``moe``                 router with bias, MXFP4 experts (expanded at load, or offloaded as
                        MXFP4 host banks and slots), clamped SwiGLU
``model``               :class:`GptOss`, its batched decode pieces, and the
                        strict weight assignment
======================  ===================================================================

Example:
    >>> from shardsmith.runtime.engine.loader import load_rank_weights  # doctest: +SKIP
    >>> w = load_rank_weights("ckpt/", rank=0, world_size=1, from_checkpoint=True)  # doctest: +SKIP
    >>> model, _ = build(w, rank=0, dtype=torch.float32, block=(128, 128), device=torch.device("cpu"))  # doctest: +SKIP
    >>> model.setup_cache(256, torch.device("cpu"), torch.float32)  # doctest: +SKIP
    >>> logits = model(torch.tensor([0, 5, 7]), 0)  # [1, V]  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardsmith.runtime.layers.parallel import Shards
from shardsmith.runtime.models.gpt_oss.config import GptOssArgs
from shardsmith.runtime.models.gpt_oss.model import GptOss, assign_weights

ARCHITECTURES = ("GptOssForCausalLM", "gpt_oss")


def build(weights, *, rank: int, dtype: torch.dtype, device: torch.device,
          place_experts: Callable[[nn.Module], Any] | None = None) -> tuple[nn.Module, Any]:
    """:class:`GptOss` for rank ``rank``, its experts resident (expanded from MXFP4 at load) or offloaded.

    Offloaded experts use the shared host banks, slots and host executor unchanged: the rank's
    stacked MXFP4 expert shards are read into host banks as they are
    (:func:`~shardsmith.pack.banks.stacked_bank_specs`: MXFP4 stays MXFP4, gate/up rows stay
    interleaved, the gate/up bias rides along) and computed with this family's
    :class:`~shardsmith.runtime.layers.experts.ExpertMath`; the down bias stays on the device,
    added once after the all-reduce as in the resident model.

    Args:
        weights: the rank's :class:`~shardsmith.runtime.engine.loader.RankWeights`; place_experts:
            the engine's expert offload, called on the ``meta`` model (then the experts are not assigned).

    Returns:
        ``(model, offload runtime or None)``.

    Raises:
        RuntimeLoadError: the weights do not fit the config (every problem listed).
    """
    args = GptOssArgs.from_config(weights.config)
    model = GptOss(args, Shards(weights.plan, rank, dtype))
    offloaded = place_experts(model) if place_experts is not None else None
    assign_weights(model, weights.dense(), device=device, offloaded=offloaded is not None)
    return model, offloaded


__all__ = ["ARCHITECTURES", "GptOss", "GptOssArgs", "assign_weights", "build"]
