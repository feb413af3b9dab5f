"""Tensor-parallel plans: one table per model family, chosen from ``config.json``.

Example:
    >>> from shardsmith.checkpoint import open_checkpoint
    >>> from shardsmith.plans import plan_checkpoint
    >>> plan = plan_checkpoint(open_checkpoint("ckpt/"), world_size=4)  # doctest: +SKIP
    >>> plan.tensors["embed.weight"].ranges[1]  # doctest: +SKIP
    ((32320, 32320),)
"""

from __future__ import annotations

from typing import Callable

from .. import families
from ..checkpoint import Checkpoint
from ..errors import PlanError
from .core import Layout, Plan, Rule, Split, partition_units
from .resolve import BankSlot, ResolvedPlan, TensorPlan, resolve
from .shapes import check_banks, check_shapes

__all__ = [
    "FAMILIES", "Layout", "Plan", "ResolvedPlan", "Rule", "Split", "TensorPlan", "BankSlot",
    "family_of", "build_plan", "plan_checkpoint", "partition_units",
]

# architecture (config.json "architectures"[0]) -> (family name, plan builder), from the one registry
FAMILIES: dict[str, tuple[str, Callable[[dict, int], Plan]]] = {
    name: (arch.family.name, families.load(arch.family.plan)) for name, arch in families.ARCHITECTURES.items()
}


def family_of(config: dict) -> str:
    """The architecture key of ``config`` in :data:`FAMILIES` (:func:`shardsmith.families.architecture_of`).

    Raises:
        PlanError: unknown architecture, listing the known ones.
    """
    arch = families.architecture_of(config)
    if arch not in FAMILIES:
        raise PlanError(f"unknown architecture {arch!r}; known: {', '.join(sorted(FAMILIES))}")
    return arch


def build_plan(config: dict, world_size: int) -> Plan:
    """The family plan for ``config`` specialised to ``world_size``.

    Raises:
        PlanError: unknown architecture or a world size the family refuses.
    """
    if world_size < 1:
        raise PlanError(f"world_size must be >= 1, got {world_size}")
    return FAMILIES[family_of(config)][1](config, world_size)


def plan_checkpoint(ckpt: Checkpoint, world_size: int, *, align: int = 1) -> ResolvedPlan:
    """Build and resolve the plan of checkpoint ``ckpt`` at ``world_size`` ranks.

    Args:
        align: extra unit (logical elements) every split axis is cut in (``--align``).

    Raises:
        PlanError: as :func:`build_plan` and :func:`~shardsmith.plans.resolve.resolve`; also when
            config.json disagrees with the tensors' shapes or counts, or one layer's experts differ
            (:mod:`~shardsmith.plans.shapes`).
    """
    if align < 1:
        raise PlanError(f"--align must be >= 1, got {align}")
    plan = resolve(build_plan(ckpt.config, world_size), ckpt.tensors, ckpt.config, world_size, align=align)
    check_shapes(plan.family, ckpt.config, ckpt.tensors, plan.experts)
    check_banks(plan.tensors)
    return plan
