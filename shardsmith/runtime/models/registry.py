"""The runtime side of the model registry: builds the model :mod:`shardsmith.families` names.

:mod:`shardsmith.families` is the one table of architectures (plan family, what each stage
supports, the runtime builder as a dotted path); this module turns a servable family into a
:class:`ModelFamily` the engine drives. Builders here:

=====================================  ==================  ===============  ===============================
architecture (``config.json``)         builder             expert offload   a step may start at
=====================================  ==================  ===============  ===============================
Mixtral, Qwen3-MoE, Qwen2-MoE          :func:`build_moe`   yes              any position (KV cache by pos)
``DeepseekV4ForCausalLM``              :func:`build_v4`    yes (FP4 slots)  0, or where the last step ended
``DeepseekV3ForCausalLM``              ``deepseek_v3``     yes (FP8 slots)  any position (latent KV by pos)
``GptOssForCausalLM``                  ``gpt_oss``         no (resident)    any position (KV cache by pos)
=====================================  ==================  ===============  ===============================

(``deepseek_v3`` and ``gpt_oss`` are :func:`shardsmith.runtime.models.deepseek_v3.build` and
:func:`shardsmith.runtime.models.gpt_oss.build`.)

Every model has the interface the engine drives: ``setup_cache(max_seq_len, device, dtype)``,
``model(ids [T], start, last_only=) -> float32 logits [T or 1, V]`` and ``model.args.vocab_size``,
plus the decode pieces :class:`~shardsmith.runtime.engine.cuda_graphs.DecodeGraphs` drives.
A builder makes the model on ``meta`` from the rank's plan and fills it from the rank's weights
(no copy on CPU); the engine then dequantizes FP8 and sets up the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardsmith import families
from shardsmith.errors import RuntimeLoadError
from shardsmith.runtime.layers.parallel import Shards
from shardsmith.runtime.models import deepseek_v4


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """One registry entry.

    Attributes:
        name: for messages.
        build: ``build(weights, *, rank, dtype, device, place_experts) -> (model, placed | None)``:
            ``place_experts(meta_model)``, when given, puts the routed experts elsewhere (the engine's
            expert offload swaps the banks) and returns what it made; the builder then assigns no banks.
        rewinds: a step may start at any position up to where the last one ended; False: only at
            0 (a new sequence) or exactly where the last step ended (state that cannot rewind).
        kv_blocks: the KV cache sits in blocks of one pool the slots share (``kv_cache_tokens``;
            :mod:`~shardsmith.runtime.models.kv_blocks`).
    """

    name: str
    build: Callable[..., tuple[nn.Module, Any]]
    rewinds: bool
    kv_blocks: bool = False


def build_moe(weights, *, rank: int, dtype: torch.dtype, device: torch.device,
              place_experts: Callable[[nn.Module], Any] | None = None) -> tuple[nn.Module, Any]:
    """The Mixtral-family :class:`~shardsmith.runtime.models.mixtral.model.Transformer`, experts resident or offloaded."""
    from shardsmith.runtime.models.mixtral.config import ModelArgs
    from shardsmith.runtime.models.mixtral.model import Transformer, assign_weights

    args = ModelArgs.from_config(weights.config)
    model = Transformer(args, Shards(weights.plan, rank, dtype))
    offloaded = place_experts(model) if place_experts is not None else None
    assign_weights(model, weights.dense(), {} if offloaded is not None else weights.banks(), device=device,
                   tied=args.tie_embeddings)
    return model, offloaded


def build_v4(weights, *, rank: int, dtype: torch.dtype, device: torch.device,
             place_experts: Callable[[nn.Module], Any] | None = None) -> tuple[nn.Module, Any]:
    """:class:`~shardsmith.runtime.models.deepseek_v4.DeepseekV4`, experts resident or offloaded.

    Offloaded FP4 experts stay packed in host memory and in the device slots (half a byte per
    weight plus one UE8M0 byte per 32) and are expanded per use with the same SwiGLU clamp and
    float32 accumulation as the resident bank.
    """
    args = deepseek_v4.V4Args.from_config(weights.config)
    model = deepseek_v4.DeepseekV4(args, Shards(weights.plan, rank, dtype))
    offloaded = place_experts(model) if place_experts is not None else None
    deepseek_v4.assign_weights(model, weights.dense(), {} if offloaded is not None else weights.banks(), device=device)
    return model, offloaded


class _Skeleton(Exception):
    """Carries the meta model out of a builder (:func:`skeleton`)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__("skeleton")
        self.model = model


def skeleton(family: ModelFamily, weights, *, rank: int, dtype: torch.dtype, **extra: Any) -> nn.Module:
    """Rank ``rank``'s model on ``meta`` as ``family``'s builder makes it from the plan, before any
    weight is assigned: every builder hands its meta model to ``place_experts`` first, and this stops
    it there. For sizes before a load: the buffers' shapes and dtypes, ``state_bytes_for``. Nothing
    is read from the weights and nothing is allocated on a device.

    Raises:
        RuntimeLoadError: the config is not supported (the builder's own error), or the builder
            assigned weights without offering its meta model.
    """
    def stop(model: nn.Module) -> Any:
        raise _Skeleton(model)

    try:
        family.build(weights, rank=rank, dtype=dtype, device=torch.device("meta"), place_experts=stop, **extra)
    except _Skeleton as made:
        return made.model
    raise RuntimeLoadError(f"{family.name}: the builder did not offer its meta model to place_experts")


def family_for(config: dict) -> ModelFamily:
    """The registry entry for ``config.json`` (:func:`shardsmith.families.architecture_of`).

    Raises:
        RuntimeLoadError: an architecture shardsmith does not know, or one it plans and splits but
            the runtime does not serve (the served ones listed).
    """
    arch = families.lookup(config)
    served = ", ".join(families.served())
    if arch is None:
        raise RuntimeLoadError(f"architecture {families.architecture_of(config)!r} is not supported by the runtime "
                               f"(supported: {served})")
    fam = arch.family
    if not fam.servable:
        raise RuntimeLoadError(f"architecture {arch.name!r} ({fam.label}) can be planned and split but is not "
                               f"served by this runtime yet (supported: {served})")
    return ModelFamily(fam.label, families.load(fam.runtime), rewinds=fam.rewinds, kv_blocks=fam.kv_blocks)
