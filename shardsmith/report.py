"""Summaries behind ``shardsmith inspect`` and ``shardsmith plan``, as plain dicts (the ``--json``
output) so that tests and tools read the same numbers the tables show.

Byte counts are per rank unless a key says ``total``. "Expected host RAM" is the rank's expert-bank
bytes: the runtime keeps routed experts in host memory and streams them into a GPU expert cache.
"""

from __future__ import annotations

from collections import Counter

from .checkpoint import Checkpoint
from .dtypes import DTYPES
from .errors import PlanError
from .plans import FAMILIES, family_of, plan_checkpoint
from .plans.core import Layout
from .plans.resolve import ResolvedPlan, detect_quant, fp8_block_size


def _category(tp_layout: Layout | None, in_bank: bool) -> str:
    if in_bank:
        return "routed_experts"
    if tp_layout is Layout.VOCAB:
        return "embeddings"
    return "dense"


def inspect_checkpoint(ckpt: Checkpoint) -> dict:
    """Architecture, layers, experts, dtypes, quantization formats and bytes by category.

    Returns:
        a JSON-ready dict. ``problems`` lists what would stop ``split`` (an unknown architecture,
        a plan that fails at world size 1, header-only shards); ``plannable`` is False when the
        plan failed (then the categories count everything as dense).
    """
    cfg = ckpt.config
    problems: list[str] = []
    plan: ResolvedPlan | None = None
    arch = ckpt.architecture
    try:
        arch = family_of(cfg)
        plan = plan_checkpoint(ckpt, 1)
    except PlanError as e:
        problems.append(str(e))
    if ckpt.header_only:
        n = sum(f.header_only for f in ckpt.files.values())
        problems.append(f"{n} of {len(ckpt.files)} shard(s) are header-only (.safetensors.json): plan works, split needs the data")
    cats: dict[str, dict[str, int]] = {}
    quant = Counter()
    fp8_block = fp8_block_size(cfg)
    for name, info in ckpt.tensors.items():
        tp = plan.tensors.get(name) if plan else None
        cat = _category(tp.layout if tp else None, bool(tp and tp.bank))
        c = cats.setdefault(cat, {"tensors": 0, "bytes": 0})
        c["tensors"] += 1
        c["bytes"] += info.nbytes
        if not name.endswith(("_scale_inv", ".scale")) and len(info.shape) == 2:
            try:
                quant[detect_quant(info, ckpt.tensors, fp8_block).format] += 1
            except PlanError as e:
                problems.append(str(e))
    experts = plan.experts if plan else {}
    return {
        "checkpoint": str(ckpt.root),
        "architecture": arch,
        "family": FAMILIES[arch][0] if arch in FAMILIES else None,
        "layers": cfg.get("num_hidden_layers"),
        "plannable": plan is not None,
        "moe_layers": len(experts),
        "mtp_layers": sum(1 for k in experts if k.startswith("mtp.")),
        "experts_per_layer": sorted(set(experts.values())),
        "experts_per_token": cfg.get("num_experts_per_tok"),
        "hidden_size": cfg.get("hidden_size"),
        "vocab_size": cfg.get("vocab_size"),
        "files": len(ckpt.files),
        "header_only": ckpt.header_only,
        "tensors": len(ckpt.tensors),
        "total_bytes": ckpt.total_bytes,
        "dtypes": dict(sorted(Counter(t.dtype for t in ckpt.tensors.values()).items())),
        "quantization": dict(sorted(quant.items())),
        "quantization_config": cfg.get("quantization_config"),
        "categories": cats,
        "problems": problems,
    }


def summarize_plan(plan: ResolvedPlan) -> dict:
    """Per-rule groups (layout, count, an example's per-rank shapes) and per-rank bytes.

    Returns:
        a JSON-ready dict with ``groups`` (one per rule, scale tensors grouped with their weight's
        rule) and ``ranks`` (``dense_bytes``, ``expert_bank_bytes``, ``host_bytes``,
        ``gpu_dense_bytes``, all per rank).
    """
    groups: dict[tuple, dict] = {}
    for tp in plan.tensors.values():
        rule = tp.rule if tp.rule >= 0 else plan.tensors[tp.scale_of].rule
        key = (rule, tp.scale_of is not None)
        g = groups.get(key)
        if g is None:
            g = groups[key] = {
                "rule": rule, "scales": tp.scale_of is not None, "layout": tp.layout.value,
                "shard_dim": tp.shard_dim, "unit": tp.unit, "partition": tp.split.value,
                "quant": tp.quant, "example": tp.name, "dtype": tp.dtype,
                "source_shape": list(tp.shape),
                "rank_shapes": [list(tp.local_shape(r)) for r in range(plan.world_size)],
                "tensors": 0, "bytes": 0,
            }
        g["tensors"] += 1
        g["bytes"] += DTYPES[tp.dtype].nbytes(tp.shape)
    ranks = []
    for r, b in enumerate(plan.bytes_per_rank()):
        ranks.append({"rank": r, "dense_bytes": b["dense"], "expert_bank_bytes": b["expert_banks"],
                      "host_bytes": b["expert_banks"], "gpu_dense_bytes": b["dense"]})
    return {
        "family": plan.family, "world_size": plan.world_size, "align": plan.align,
        "notes": list(plan.notes), "moe_layers": len(plan.experts),
        "groups": sorted(groups.values(), key=lambda g: (g["rule"], g["scales"])), "ranks": ranks,
    }
