"""Resolve a :class:`~shardsmith.plans.core.Plan` against a checkpoint's tensor table.

The result, a :class:`ResolvedPlan`, says for every source tensor (weights and scales alike) its
layout, the dim split, the unit, and each rank's ``[start, length)`` ranges in stored elements of
that dim. It is plain data: the writer slices from it, ``verify`` rechecks it from the manifest,
and the runtime rebuilds rank-local shapes from it.

Quantization formats (how a scale tensor follows its weight, block for block):

==========  ===========================  ==============================  =====================
format      weight                       scale                           block (stored units)
==========  ===========================  ==============================  =====================
fp8-block   F8_E4M3 ``[R, C]``           ``weight_scale_inv`` F32 or     ``weight_block_size``
                                         ``.scale`` F8_E8M0              (128x128 V3/V4)
                                         ``[ceil(R/b0), ceil(C/b1)]``
fp4-group   I8/U8 ``[R, C/2]`` (two      ``.scale`` F8_E8M0 ``[R, C/32]``  1 x 16 bytes
            e2m1 per byte) or F4 ``[R,C]``                               (1 x 32 for F4)
==========  ===========================  ==============================  =====================

Sources: DeepSeek-V3 ``inference/kernel.py`` (FP8 128x128 blocks, ``weight_scale_inv``),
DeepSeek-V4 release checkpoint headers (``.scale`` E8M0; FP4 experts as I8 with 1x32 scales).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..checkpoint import TensorInfo
from ..dtypes import DTYPES
from ..errors import PlanError, format_problems
from .core import BankArray, Layout, Plan, Range, Rule, Split, check_block_cuts, kv_copies, lcm, natural_key, partition_units, segmented

SCALE_SUFFIXES = ("_scale_inv", ".scale")


@dataclass(frozen=True, slots=True)
class Quant:
    """A weight's quantization format.

    Attributes:
        format: ``none``, ``fp8-block`` or ``fp4-group``.
        block: block size in stored elements per dim (``(1, 1)`` when unquantized).
        pack: logical elements per stored element on the last dim (2 for e2m1 packed in I8/U8).
        scale: name of the scale tensor, or ``None``.
    """

    format: str = "none"
    block: tuple[int, ...] = (1, 1)
    pack: int = 1
    scale: str | None = None


@dataclass(frozen=True, slots=True)
class BankSlot:
    """Where a routed-expert tensor's shard goes in its layer's bank.

    Attributes:
        layer: layer key, the name prefix before the expert list (``layers.3``, ``mtp.0``);
        expert: expert index; array: bank array; segment: 0 gate/down, 1 up;
        scale: True for the scale array (``gate_up_scale``/``down_scale``).
    """

    layer: str
    expert: int
    array: BankArray
    segment: int
    scale: bool = False

    @property
    def array_name(self) -> str:
        """Bank array name: ``gate_up``, ``down``, ``gate_up_scale`` or ``down_scale``."""
        return self.array.value + ("_scale" if self.scale else "")


@dataclass(frozen=True, slots=True)
class TensorPlan:
    """The resolved plan of one source tensor.

    Attributes:
        name, dtype, shape: as in the source header.
        layout: the layout; ``rule``: index of the matching rule (``-1`` for a scale tensor, which
            follows its weight).
        shard_dim: dim split (non-negative), ``None`` when replicated.
        unit: stored elements per unit along ``shard_dim`` (1 when replicated).
        split: how units were dealt.
        ranges: per rank, the ``(start, length)`` ranges along ``shard_dim`` (one per segment);
            a replicated tensor has one range covering dim 0 (or ``(0, 1)`` for a scalar).
        quant: quantization format of the weight (or of the weight this scale follows).
        scale_of: for a scale tensor, its weight's name.
        bank: for a routed-expert tensor, its bank slot.
        block: the quantization block in stored elements per dim (the weight's, for its scale too),
            read once at planning (:func:`fp8_block_size`); ``()`` when unquantized.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    layout: Layout
    rule: int
    shard_dim: int | None
    unit: int
    split: Split
    ranges: tuple[tuple[Range, ...], ...]
    quant: str = "none"
    scale_of: str | None = None
    bank: BankSlot | None = None
    block: tuple[int, ...] = ()

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Rank ``rank``'s shape: the source shape with the shard dim's total share length."""
        if self.shard_dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.shard_dim] = sum(length for _, length in self.ranges[rank])
        return tuple(shape)

    def local_nbytes(self, rank: int) -> int:
        """Bytes of rank ``rank``'s shard."""
        return DTYPES[self.dtype].nbytes(self.local_shape(rank))


@dataclass(frozen=True, slots=True)
class ResolvedPlan:
    """A plan resolved for one checkpoint and world size.

    Attributes:
        family: plan family; world_size: ranks; align: the ``--align`` unit (1 if none).
        notes: plan-wide decisions (e.g. replicated attention and why).
        tensors: every source tensor's plan, in checkpoint order.
        experts: routed experts per MoE layer key (``layers.3`` -> 256); empty for dense models.
    """

    family: str
    world_size: int
    align: int
    notes: tuple[str, ...]
    tensors: dict[str, TensorPlan]
    experts: dict[str, int]

    def rank_bytes(self, rank: int) -> dict[str, int]:
        """Rank ``rank``'s bytes by category: ``dense`` (non-bank) and ``expert_banks``."""
        return self.bytes_per_rank()[rank]

    def bytes_per_rank(self) -> list[dict[str, int]]:
        """Every rank's ``dense`` and ``expert_banks`` bytes, in one pass over the tensors."""
        out = [{"dense": 0, "expert_banks": 0} for _ in range(self.world_size)]
        for tp in self.tensors.values():
            key = "expert_banks" if tp.bank else "dense"
            total = DTYPES[tp.dtype].nbytes(tp.shape)
            if tp.shard_dim is None:
                for row in out:
                    row[key] += total
                continue
            size = tp.shape[tp.shard_dim]
            for row, ranges in zip(out, tp.ranges):  # bytes scale with the share of the split axis
                row[key] += total * sum(n for _, n in ranges) // size
        return out


def fp8_block_size(config: dict) -> tuple[int, int]:
    """FP8 ``weight_block_size`` from ``config.json``'s ``quantization_config``, in elements per dim
    (128x128 when absent, DeepSeek-V3's convention). Read once per plan; the plan keeps it per tensor."""
    qc = config.get("quantization_config") or {}
    return tuple(int(b) for b in (qc.get("weight_block_size") or (128, 128)))


def detect_quant(info: TensorInfo, tensors: dict[str, TensorInfo], fp8_block: tuple[int, int]) -> Quant:
    """The quantization format of weight ``info`` from its dtype and its scale tensor, if any.

    Args:
        fp8_block: the checkpoint's FP8 block size (:func:`fp8_block_size`).

    Raises:
        PlanError: a scale tensor whose shape does not match the weight's blocks.
    """
    scale = None
    if info.name.endswith(".weight"):
        stem = info.name[: -len(".weight")]
        for cand in (stem + ".weight_scale_inv", stem + ".scale"):
            if cand in tensors:
                scale = tensors[cand]
                break
    if scale is None:
        return Quant()
    if len(info.shape) != 2 or len(scale.shape) != 2:
        raise PlanError(f"{scale.name}: scale {list(scale.shape)} for weight {info.name} {list(info.shape)}: only 2-D block scales are supported")
    rows, cols = info.shape
    if info.dtype.startswith("F8_E4") or info.dtype.startswith("F8_E5"):
        block, fmt, pack = tuple(fp8_block), "fp8-block", 1
    elif info.dtype in ("I8", "U8") and scale.dtype == "F8_E8M0":
        block, fmt, pack = (1, 16), "fp4-group", 2
    elif info.dtype == "F4":
        block, fmt, pack = (1, 32), "fp4-group", 1
    else:
        raise PlanError(f"{info.name}: {info.dtype} weight with {scale.dtype} scale {scale.name} is not a known quantization format")
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != want:
        raise PlanError(
            f"{scale.name}: shape {list(scale.shape)} does not match {fmt} blocks {list(block)} of "
            f"weight {info.name} {list(info.shape)} (expected {list(want)})"
        )
    return Quant(fmt, block, pack, scale.name)


def _kept_block(q: Quant) -> tuple[int, ...]:
    """The block a :class:`TensorPlan` keeps: ``q.block``, or ``()`` when unquantized."""
    return tuple(q.block) if q.format != "none" else ()


_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")


def _match(plan: Plan, name: str, memo: dict[str, int]) -> tuple[int, Rule, re.Match]:
    """The one rule matching ``name``; ``memo`` maps index-free names to a rule already proven
    unique for that shape (``layers.#.ffn.experts.#.w1.weight``), so each shape scans all rules once."""
    key = _LAYER_INDEX.sub(".#", name)
    idx = memo.get(key)
    if idx is not None and (m := plan.rules[idx].match(name)):
        return idx, plan.rules[idx], m
    hits = [(i, r, m) for i, r in enumerate(plan.rules) if (m := r.match(name))]
    if not hits:
        raise PlanError(f"tensor {name!r} matches no rule of the {plan.family} plan")
    if len(hits) > 1:
        pats = ", ".join(repr(r.pattern) for _, r, _ in hits)
        raise PlanError(f"tensor {name!r} matches {len(hits)} rules of the {plan.family} plan: {pats}")
    memo[key] = hits[0][0]
    return hits[0]


def _ranges(rule: Rule, info: TensorInfo, q: Quant, dim: int, world_size: int, align: int) -> tuple[int, list[tuple[Range, ...]]]:
    pack = q.pack if dim == len(info.shape) - 1 else 1
    # logical units become whole stored elements (two e2m1 values per byte)
    block = q.block[dim] if dim < len(q.block) else 1
    what = f"{info.name} dim {dim}"
    if block > 1:  # the unit is a whole scale block: say so, a cut inside one would split its scale
        what += f" ({info.dtype} {q.format}, {block}-element scale blocks: a cut may not fall inside one)"
    if rule.merge_block:
        unit = lcm(lcm(rule.unit, pack) // pack, lcm(align, pack) // pack, block)
    else:  # the model fixes the unit (heads, groups): no --align, and block cuts are errors
        unit = lcm(rule.unit, pack) // pack
    size = info.shape[dim]
    if rule.split is Split.KV_COPIES:
        q_rows, group, n_q = rule.kv_for
        q_shares = partition_units(n_q * q_rows, q_rows, world_size, what=f"{info.name} query heads")
        ranges = [(r,) for r in kv_copies(q_shares, q_rows, group, rule.unit)]
    elif rule.segments:
        segs = tuple(s // pack for s in rule.segments)
        if sum(segs) != size:
            raise PlanError(f"{what}: segments {list(rule.segments)} do not add up to size {size}")
        per = [partition_units(s, unit, world_size, exact=rule.split is Split.EXACT, what=f"{what} segment {i}")
               for i, s in enumerate(segs)]
        ranges = segmented(segs, per)
    else:
        ranges = [(r,) for r in partition_units(size, unit, world_size, exact=rule.split is Split.EXACT, what=what)]
    check_block_cuts(ranges, block, size, what=f"{info.name} dim {dim} ({info.dtype} {q.format})", world_size=world_size)
    return unit, ranges


def _scale_ranges(ranges: list[tuple[Range, ...]], block: int) -> list[tuple[Range, ...]]:
    out = []
    for rank_ranges in ranges:
        out.append(tuple((s // block, -(-(s + n) // block) - s // block) for s, n in rank_ranges))
    return out


def resolve(plan: Plan, tensors: dict[str, TensorInfo], config: dict, world_size: int, *, align: int = 1) -> ResolvedPlan:
    """Match every tensor to one rule and compute each rank's slices.

    Args:
        plan: the family plan (already specialised to ``world_size`` by its builder).
        tensors: the checkpoint's tensor table.
        config: ``config.json`` (for ``quantization_config``).
        world_size: number of ranks (>= 1).
        align: extra alignment unit in logical elements for every split axis (``--align``).

    Returns:
        the :class:`ResolvedPlan`, tensors in checkpoint order.

    Raises:
        PlanError: listing every tensor with no rule or several, every cut inside a block, every
            orphan scale and every axis too small for ``world_size``.
    """
    if world_size < 1:
        raise PlanError(f"world_size must be >= 1, got {world_size}")
    problems: list[str] = []
    out: dict[str, TensorPlan] = {}
    scales: dict[str, tuple[TensorPlan, Quant]] = {}
    memo: dict[str, int] = {}
    shares: dict[tuple, tuple[int, list]] = {}
    fp8_block = fp8_block_size(config)
    is_scale = {n for n in tensors if n.endswith(SCALE_SUFFIXES)}
    refused_scales: set[str] = set()  # scales of weights refused above: their weight's problem names them
    for name, info in tensors.items():
        if name in is_scale:
            continue
        q = None
        try:
            idx, rule, m = _match(plan, name, memo)
            q = detect_quant(info, tensors, fp8_block)
            bank = None
            if rule.bank is not None:
                layer, expert = m.group(rule.bank.layer_group), int(m.group(rule.bank.expert_group))
                bank = BankSlot(layer, expert, rule.bank.array, rule.bank.segment)
            if rule.layout is Layout.REPLICATED:
                rng = ((0, info.shape[0] if info.shape else 1),)
                tp = TensorPlan(name, info.dtype, info.shape, rule.layout, idx, None, 1, Split.NONE,
                                (rng,) * world_size, q.format, None, bank, _kept_block(q))
            else:
                dim = rule.shard_dim % len(info.shape)
                key = (idx, info.dtype, info.shape, q.block, q.pack, dim)  # experts share a few shapes
                if key not in shares:
                    shares[key] = _ranges(rule, info, q, dim, world_size, align)
                unit, ranges = shares[key]
                tp = TensorPlan(name, info.dtype, info.shape, rule.layout, idx, dim, unit, rule.split,
                                tuple(ranges), q.format, None, bank, _kept_block(q))
            out[name] = tp
            if q.scale:
                scales[q.scale] = (tp, q)
        except PlanError as e:
            problems.append(str(e))
            if q is not None and q.scale:
                refused_scales.add(q.scale)
    for name in sorted(is_scale - scales.keys() - refused_scales):
        problems.append(f"scale tensor {name!r} has no weight tensor it follows")
    if problems:
        raise PlanError(format_problems(f"cannot plan {plan.family} at world_size={world_size}", problems))
    # scales follow their weights, in checkpoint order
    ordered: dict[str, TensorPlan] = {}
    for name, info in tensors.items():
        if name in out:
            ordered[name] = out[name]
            continue
        w, q = scales[name]
        bank = None
        if w.bank is not None:
            bank = BankSlot(w.bank.layer, w.bank.expert, w.bank.array, w.bank.segment, scale=True)
        if w.shard_dim is None:
            rng = ((0, info.shape[0]),)
            ordered[name] = TensorPlan(name, info.dtype, info.shape, w.layout, -1, None, 1, Split.NONE,
                                       (rng,) * world_size, q.format, w.name, bank, w.block)
        else:
            block = q.block[w.shard_dim]
            ordered[name] = TensorPlan(name, info.dtype, info.shape, w.layout, -1, w.shard_dim,
                                       max(w.unit // block, 1), w.split, tuple(_scale_ranges(list(w.ranges), block)),
                                       q.format, w.name, bank, w.block)
    counts = _expert_counts([tp for tp in out.values() if tp.bank is not None])
    return ResolvedPlan(plan.family, world_size, align, plan.notes, ordered, counts)


def _expert_counts(experts: list[TensorPlan]) -> dict[str, int]:
    """Experts per layer; every expert of a layer must have gate, up and down.

    Args:
        experts: the routed-expert weights (``bank`` set) of the plan.

    Raises:
        PlanError: listing each layer's missing experts, and each missing projection by the source
            tensor name it would have (taken from another expert of the layer that has it).
    """
    have: dict[str, dict[int, dict[tuple[BankArray, int], str]]] = {}
    for tp in experts:
        s = tp.bank
        have.setdefault(s.layer, {}).setdefault(s.expert, {})[(s.array, s.segment)] = tp.name
    full = {(BankArray.GATE_UP, 0): "gate (w1)", (BankArray.GATE_UP, 1): "up (w3)", (BankArray.DOWN, 0): "down (w2)"}
    problems = []
    for layer, by_expert in sorted(have.items(), key=lambda kv: natural_key(kv[0])):
        n = max(by_expert) + 1
        missing = [e for e in range(n) if e not in by_expert]
        if missing:
            problems.append(f"layer {layer}: routed experts {missing[:8]} missing (max index {n - 1})")
        for e, parts in sorted(by_expert.items()):
            for slot in sorted(full.keys() - parts.keys()):
                label = f"{slot[0].value}[{slot[1]}], the {full[slot]} projection"
                other = next(((o, names[slot]) for o, names in by_expert.items() if slot in names), None)
                if other is None:
                    problems.append(f"layer {layer} expert {e}: missing its {label} (no expert of the layer has one)")
                    continue
                head, sep, tail = other[1].rpartition(f".{other[0]}.")
                problems.append(f"layer {layer} expert {e}: missing tensor {head}.{e}.{tail!s} ({label})" if sep else
                                f"layer {layer} expert {e}: missing its {label} (expert {other[0]} has {other[1]})")
    if problems:
        raise PlanError(format_problems("incomplete routed experts", problems))
    return {layer: max(by_expert) + 1 for layer, by_expert in sorted(have.items(), key=lambda kv: natural_key(kv[0]))}
