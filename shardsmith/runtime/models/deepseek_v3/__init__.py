"""DeepSeek-V3 (and R1, V3.1: the same architecture) in the runtime, from Hugging Face checkpoint names.

==============  ===================================================================
module          contents
==============  ===================================================================
``config``      :class:`V3Args` from ``config.json``; YaRN frequencies, mscale, tables
``attention``   MLA over the rank's heads, latent KV cache, absorbed decode
``moe``         ``noaux_tc`` router; routed (Mixtral-family bank) and shared experts
``model``       :class:`DeepseekV3`, its MTP draft layer, the strict weight assignment
==============  ===================================================================

Example:
    >>> from shardsmith.runtime.engine.loader import load_rank_weights  # doctest: +SKIP
    >>> w = load_rank_weights("pack/", rank=0, world_size=1)  # doctest: +SKIP
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
from shardsmith.runtime.models.deepseek_v3.config import ARCHITECTURES, V3Args
from shardsmith.runtime.models.deepseek_v3.model import DeepseekV3, assign_weights


def build(weights, *, rank: int, dtype: torch.dtype, device: torch.device,
          place_experts: Callable[[nn.Module], Any] | None = None, mtp_layers: int = 0) -> tuple[nn.Module, Any]:
    """:class:`DeepseekV3` for rank ``rank``, routed experts resident or offloaded (the registry's builder).

    Offloaded experts use the shared host banks, slots and host executor unchanged (the bank format
    is the Mixtral family's); FP8 experts stay FP8 in host memory and in the slots.

    Args:
        weights: a :class:`~shardsmith.runtime.engine.loader.RankWeights`; place_experts: the
            engine's expert offload, called on the ``meta`` model (then no banks are assigned).
        mtp_layers: MTP layers to load for speculative drafts (0 or 1); offloaded, the MTP layer's
            experts join the expert cache as one more layer.

    Returns:
        ``(model, offload runtime or None)``; the caller dequantizes FP8 and sets up the cache.

    Raises:
        RuntimeLoadError: an unsupported config, or missing/unexpected/mis-shaped tensors (all listed).
        UsageError: more MTP layers than the checkpoint has.
    """
    args = V3Args.from_config(weights.config)
    model = DeepseekV3(args, Shards(weights.plan, rank, dtype), mtp_layers=mtp_layers)
    offloaded = place_experts(model) if place_experts is not None else None
    assign_weights(model, weights.dense(), {} if offloaded is not None else weights.banks(), device=device)
    return model, offloaded


__all__ = ["ARCHITECTURES", "DeepseekV3", "V3Args", "assign_weights", "build"]
