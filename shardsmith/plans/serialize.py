"""A :class:`~shardsmith.plans.resolve.ResolvedPlan` to and from plain data (the manifest's ``plan``).

``verify`` and the runtime rebuild the plan from the manifest alone, without the family tables,
so a pack stays checkable even if the plan code changes. Field meanings: ``manifests/README.md``.

``block`` (a quantized tensor's block size) is written since the plan kept it; a plan written
before has none, and :func:`plan_from_dict` gives its quantized tensors the block every
block-quantized checkpoint split then had (:data:`LEGACY_BLOCKS`); a different real block shows
up at load as scale buffers that do not fit the stored scales (unless both give as many blocks).
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import ManifestError
from .core import BankArray, Layout, Split
from .resolve import BankSlot, ResolvedPlan, TensorPlan

# quant format (and weight dtype) -> block of a plan.json written without "block" (stored elements)
LEGACY_BLOCKS = {"fp8-block": (128, 128), ("fp4-group", "F4"): (1, 32), "fp4-group": (1, 16)}


def plan_to_dict(plan: ResolvedPlan) -> dict:
    """The plan as JSON/YAML-ready data (tensors in checkpoint order)."""
    tensors = {}
    for name, tp in plan.tensors.items():
        d = {
            "dtype": tp.dtype, "shape": list(tp.shape), "layout": tp.layout.value, "rule": tp.rule,
            "shard_dim": tp.shard_dim, "unit": tp.unit, "partition": tp.split.value, "quant": tp.quant,
            "ranges": [[list(r) for r in rank] for rank in tp.ranges],
        }
        if tp.scale_of:
            d["scale_of"] = tp.scale_of
        if tp.block:
            d["block"] = list(tp.block)
        if tp.bank:
            d["bank"] = {"layer": tp.bank.layer, "expert": tp.bank.expert, "array": tp.bank.array.value,
                         "segment": tp.bank.segment, "scale": tp.bank.scale}
        tensors[name] = d
    return {"family": plan.family, "world_size": plan.world_size, "align": plan.align,
            "notes": list(plan.notes), "experts": dict(plan.experts), "tensors": tensors}


def plan_from_dict(data: dict) -> ResolvedPlan:
    """Rebuild a :class:`ResolvedPlan` from :func:`plan_to_dict` output.

    Raises:
        ManifestError: a missing field or an unknown layout / partition / bank array.
    """
    try:
        tensors = {}
        for name, d in data["tensors"].items():
            bank = None
            if "bank" in d:
                b = d["bank"]
                bank = BankSlot(str(b["layer"]), int(b["expert"]), BankArray(b["array"]), int(b["segment"]), bool(b["scale"]))
            quant = d.get("quant", "none")
            tensors[name] = TensorPlan(
                name, d["dtype"], tuple(d["shape"]), Layout(d["layout"]), int(d["rule"]), d["shard_dim"],
                int(d["unit"]), Split(d["partition"]),
                tuple(tuple((int(s), int(n)) for s, n in rank) for rank in d["ranges"]),
                quant, d.get("scale_of"), bank, tuple(int(b) for b in d["block"]) if "block" in d else (),
            )
        _legacy_blocks(tensors)
        return ResolvedPlan(data["family"], int(data["world_size"]), int(data["align"]), tuple(data["notes"]),
                            tensors, {str(k): int(v) for k, v in data["experts"].items()})
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"plan in manifest is malformed: {type(e).__name__}: {e}") from None


def _legacy_blocks(tensors: dict[str, TensorPlan]) -> None:
    """Give the quantized tensors of a plan written without ``block`` their :data:`LEGACY_BLOCKS` block
    (a scale its weight's), in place."""
    for name, tp in tensors.items():
        if tp.quant != "none" and not tp.block:
            weight = tensors.get(tp.scale_of, tp) if tp.scale_of else tp
            block = LEGACY_BLOCKS.get((tp.quant, weight.dtype)) or LEGACY_BLOCKS.get(tp.quant, ())
            tensors[name] = replace(tp, block=block)
