"""The one registry of model families: which architectures shardsmith plans, splits and serves.

Torch-free, so ``plan``, ``split``, ``inspect`` and the README read it without the runtime. Plan
builders and runtime builders are dotted paths (``module:function``) imported only when used.

======================================  ============  ==========  =====  ===============  ==================
architecture (``config.json``)          plan family   plan/split  serve  expert offload   formats served
======================================  ============  ==========  =====  ===============  ==================
Mixtral, Qwen3-MoE, Qwen2-MoE           ``mixtral``   yes         yes    yes              unquantized, FP8
``DeepseekV4ForCausalLM``               deepseek-v4   yes         yes    yes (FP4 slots)  + FP4 experts
``DeepseekV3ForCausalLM``               deepseek-v3   yes         yes    yes (FP8 slots)  unquantized, FP8
``GptOssForCausalLM``                   gpt-oss       yes         yes    yes (MXFP4)      MXFP4 (expanded)
======================================  ============  ==========  =====  ===============  ==================

Which architecture a ``config.json`` is (:func:`architecture_of`), one rule for every caller:
``architectures[0]`` when the list is there, else the architecture of ``model_type``.

Example:
    >>> from shardsmith.families import family_of
    >>> family_of({"architectures": ["DeepseekV4ForCausalLM"]}).servable
    True
    >>> serve_warning({"model_type": "deepseek_v3"}) is None
    True

"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Family:
    """One model family and what each stage supports.

    Attributes:
        name: the plan family (``mixtral``, ``deepseek-v4``; the plan's and pack's ``family``).
        label: for messages (``Mixtral family``).
        plan: the plan builder, ``module:function`` (``build(config, world_size) -> Plan``).
        runtime: the runtime builder, ``module:function`` (see
            :mod:`shardsmith.runtime.models.registry`); None when the runtime cannot serve the family.
        offload: routed experts can be offloaded (``--moe-backend``).
        quant: weight formats the runtime runs (``none``, ``fp8-block``, ``fp4-group``).
        rewinds: a step may start at any position up to where the last one ended; False: only at
            0 or exactly where the last step ended (state that cannot rewind).
        kv_blocks: the runtime keeps its KV cache in blocks of one pool that every slot shares
            (``--kv-cache-tokens``; :mod:`shardsmith.runtime.models.kv_blocks`); False: each slot holds
            state for ``max_seq_len`` positions.
    """

    name: str
    label: str
    plan: str
    runtime: str | None = None
    offload: bool = False
    quant: tuple[str, ...] = ()
    rewinds: bool = True
    kv_blocks: bool = False

    @property
    def servable(self) -> bool:
        """Whether ``serve``/``generate`` run this family."""
        return self.runtime is not None


@dataclass(frozen=True, slots=True)
class Architecture:
    """One ``config.json`` architecture: its name, ``model_type`` and family."""

    name: str
    model_type: str
    family: Family


MIXTRAL = Family("mixtral", "Mixtral family", "shardsmith.plans.hf_moe:build",
                 runtime="shardsmith.runtime.models.registry:build_moe", offload=True, quant=("none", "fp8-block"),
                 kv_blocks=True)
DEEPSEEK_V4 = Family("deepseek-v4", "DeepSeek-V4", "shardsmith.plans.deepseek_v4:build",
                     runtime="shardsmith.runtime.models.registry:build_v4", offload=True,
                     quant=("none", "fp8-block", "fp4-group"), rewinds=False)
DEEPSEEK_V3 = Family("deepseek-v3", "DeepSeek-V3", "shardsmith.plans.deepseek_v3:build",
                     runtime="shardsmith.runtime.models.deepseek_v3:build", offload=True, quant=("none", "fp8-block"),
                     kv_blocks=True)
GPT_OSS = Family("gpt-oss", "gpt-oss", "shardsmith.plans.gpt_oss:build",
                 runtime="shardsmith.runtime.models.gpt_oss:build", offload=True, quant=("mxfp4",), kv_blocks=True)

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("DeepseekV4ForCausalLM", "deepseek_v4", DEEPSEEK_V4),
    Architecture("DeepseekV3ForCausalLM", "deepseek_v3", DEEPSEEK_V3),
    Architecture("MixtralForCausalLM", "mixtral", MIXTRAL),
    Architecture("Qwen3MoeForCausalLM", "qwen3_moe", MIXTRAL),
    Architecture("Qwen2MoeForCausalLM", "qwen2_moe", MIXTRAL),
    Architecture("GptOssForCausalLM", "gpt_oss", GPT_OSS),
)}
MODEL_TYPES: dict[str, str] = {a.model_type: a.name for a in ARCHITECTURES.values()}


def architecture_of(config: dict) -> str:
    """The architecture name of ``config.json``: ``architectures[0]``, else that of ``model_type``
    (which may be unknown: check with :data:`ARCHITECTURES`)."""
    archs = config.get("architectures") or []
    if archs:
        return str(archs[0])
    model_type = str(config.get("model_type"))
    return MODEL_TYPES.get(model_type, model_type)


def lookup(config: dict) -> Architecture | None:
    """The registry entry of ``config.json``'s architecture, or None when shardsmith does not know it."""
    return ARCHITECTURES.get(architecture_of(config))


def family_of(config: dict) -> Family | None:
    """The family of ``config.json``'s architecture, or None when unknown."""
    arch = lookup(config)
    return None if arch is None else arch.family


def served() -> list[str]:
    """Architectures the runtime serves, in registry order."""
    return [a.name for a in ARCHITECTURES.values() if a.family.servable]


def serve_warning(config: dict) -> str | None:
    """One line for ``plan``/``split`` when the runtime cannot serve ``config.json``'s family (None
    when it can, or when the architecture is unknown: planning refuses that itself)."""
    family = family_of(config)
    if family is None or family.servable:
        return None
    return (f"the runtime cannot serve {family.label} yet: this pack can be split and verified, not served "
            f"(served: {', '.join(served())})")


def load(path: str) -> Callable[..., Any]:
    """The object at ``module:attribute`` (imported now)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
