"""gpt-oss in the runtime: tensor-parallel forward pass from the release checkpoint's names.

======================  ===================================================================
module                  contents
======================  ===================================================================
``config``              :class:`GptOssArgs` from ``config.json``; YaRN cos/sin tables
``attention``           GQA with sinks, sliding/full layers, per-sequence KV slots
``moe``                 router with bias, MXFP4 experts expanded at load, clamped SwiGLU
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

from typing import Any

import torch
from torch import nn

from shardsmith.errors import RuntimeLoadError
from shardsmith.runtime.layers.parallel import Shards
from shardsmith.runtime.models.gpt_oss.config import GptOssArgs
from shardsmith.runtime.models.gpt_oss.model import GptOss, assign_weights

ARCHITECTURES = ("GptOssForCausalLM", "gpt_oss")


def build(weights, *, rank: int, dtype: torch.dtype, device: torch.device,
          place_experts: Any = None) -> tuple[nn.Module, None]:
    """:class:`GptOss` for rank ``rank``, its experts resident and expanded from MXFP4 at load.

    Args:
        weights: the rank's :class:`~shardsmith.runtime.engine.loader.RankWeights`; place_experts:
            the engine's expert offload (the registry's builder signature; refused here).

    Raises:
        RuntimeLoadError: expert offload was asked for (gpt-oss experts are resident only for now),
            or the weights do not fit the config (every problem listed).
    """
    if place_experts is not None:
        raise RuntimeLoadError("gpt-oss: expert offload is not supported yet (its experts are resident, "
                               "expanded from MXFP4 at load); serve without offload")
    args = GptOssArgs.from_config(weights.config)
    model = GptOss(args, Shards(weights.plan, rank, dtype))
    assign_weights(model, weights.dense(), device=device)
    return model, None


__all__ = ["ARCHITECTURES", "GptOss", "GptOssArgs", "assign_weights", "build"]
