"""Tensor-parallel plans as data: layouts, rules, and the pure slice arithmetic.

A :class:`Plan` is an ordered, immutable table of :class:`Rule` rows. Each source tensor matches
exactly one rule (by regular expression on its name); the rule names its layout, the dim that is
split, the unit a share is made of (a head, an output group, a quantization block) and, for fused
tensors, the segments cut separately. Quantization scale tensors are not matched on their own:
they follow their weight (:class:`ScaleSpec`), block for block.

Layouts (weights are ``[out, in]`` as in ``torch.nn.Linear``):

===================  =========  ===============================================================
layout               shard dim  meaning
===================  =========  ===============================================================
replicated           none       every rank holds the whole tensor
column-parallel      0          output features split; no communication after
row-parallel         1          input features split; partial outputs all-reduced (bias once)
vocab-parallel       0          embedding / LM head rows split by vocabulary
tp-within-expert     0 or 1     expert gate/up split on intermediate rows, down on its columns
head-grouped         0 or 1     split by whole attention heads or output groups
===================  =========  ===============================================================

Share arithmetic (:func:`partition_units`): an axis of ``size`` elements is cut into whole units of
``unit`` elements (the last unit may be short, a ragged edge); the units are dealt front-loaded so
that shares differ by at most one unit. With ``--align 128`` at world_size 4, 2304 rows give
640/640/512/512 and 129280 vocabulary rows give 32384/32384/32256/32256.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field

from ..errors import PlanError

Range = tuple[int, int]  # (start, length) along the shard dim, in stored elements


class Layout(str, enum.Enum):
    """The closed set of tensor-parallel layouts (values are the manifest spellings)."""

    REPLICATED = "replicated"
    COLUMN = "column-parallel"
    ROW = "row-parallel"
    VOCAB = "vocab-parallel"
    EXPERT = "tp-within-expert"
    HEAD_GROUPED = "head-grouped"


class Split(str, enum.Enum):
    """How a split axis is dealt out (the manifest's ``partition`` field)."""

    NONE = "none"  # replicated
    UNITS = "front-loaded-units"  # whole units, shares differ by at most one unit
    EXACT = "equal-units"  # whole units, equal shares required (else PlanError)
    KV_COPIES = "kv-copies"  # the KV heads read by this rank's query heads (may repeat)


class BankArray(str, enum.Enum):
    """Arrays of a layer's expert bank (see ``manifests/README.md``)."""

    GATE_UP = "gate_up"  # [E, 2*I_r, H]: rows [0, I_r) gate (w1), [I_r, 2*I_r) up (w3)
    DOWN = "down"  # [E, H, I_r]


@dataclass(frozen=True, slots=True)
class BankRole:
    """Where a routed expert's tensor goes in its layer's bank.

    Attributes:
        array: the bank array.
        segment: 0 for gate (w1) or down, 1 for up (w3), stacked after gate on dim 1 of the bank.
        layer_group / expert_group: regex group numbers holding the layer key (a name prefix
            such as ``layers.3`` or ``mtp.0``) and the expert index.
    """

    array: BankArray
    segment: int
    layer_group: int = 1
    expert_group: int = 2


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of a plan.

    Attributes:
        pattern: regular expression matched in full against the source tensor name.
        layout: the :class:`Layout`.
        shard_dim: dim split (``None`` for replicated); negative counts from the end.
        unit: semantic unit along the split dim in logical elements (a head's rows, a group's
            rows); 1 when any cut is fine.
        split: how units are dealt (:class:`Split`).
        segments: for fused tensors, sizes (logical elements) of consecutive segments along the
            split dim, each partitioned on its own; empty for an unfused tensor.
        bank: for routed experts, the bank slot; ``None`` for dense tensors.
        merge_block: True when the quantization block and ``--align`` may be folded into the
            unit (experts, vocabulary, plain column/row splits); False when the model fixes the
            unit (heads, output groups): ``--align`` is ignored and a cut inside a block is an error.
        kv_for: for :attr:`Split.KV_COPIES`: (rows per query head, query heads per KV head,
            query heads); :attr:`unit` is then the rows of one KV head.
        note: why this rule exists (shown by ``shardsmith plan``).
    """

    pattern: str
    layout: Layout
    shard_dim: int | None = None
    unit: int = 1
    split: Split = Split.UNITS
    segments: tuple[int, ...] = ()
    bank: BankRole | None = None
    merge_block: bool = True
    kv_for: tuple[int, int, int] = ()
    note: str = ""
    _rx: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_rx", re.compile(self.pattern))
        if (self.layout is Layout.REPLICATED) != (self.shard_dim is None):
            raise PlanError(f"rule {self.pattern!r}: replicated rules take no shard_dim, others need one")

    def match(self, name: str) -> re.Match | None:
        """Full match of ``name`` against :attr:`pattern`."""
        return self._rx.fullmatch(name)


@dataclass(frozen=True, slots=True)
class Plan:
    """An ordered table of rules for one model family.

    Attributes:
        family: family name (``deepseek-v4``, ``mixtral``, ...).
        rules: the rules, in order.
        notes: plan-wide decisions the user should see (e.g. why attention is replicated).
    """

    family: str
    rules: tuple[Rule, ...]
    notes: tuple[str, ...] = ()


def partition_units(
    size: int, unit: int, world_size: int, *, exact: bool = False, what: str = "axis"
) -> list[Range]:
    """Deal ``size`` elements to ``world_size`` ranks in whole units, front-loaded.

    The axis holds ``ceil(size / unit)`` units (the last may be short). Rank ``r`` gets
    ``n // W + (r < n % W)`` consecutive units, so shares differ by at most one unit.

    Args:
        size: elements along the axis.
        unit: elements per unit (>= 1).
        world_size: number of ranks (>= 1).
        exact: require equal shares (``size`` divisible by ``unit * world_size``).
        what: description used in error messages (tensor and dim).

    Returns:
        ``[(start, length)]`` per rank, tiling ``[0, size)`` in order.

    Raises:
        PlanError: fewer units than ranks, or unequal shares when ``exact``.

    Example:
        >>> partition_units(2304, 128, 4)
        [(0, 640), (640, 640), (1280, 512), (1792, 512)]
    """
    if unit < 1 or world_size < 1:
        raise PlanError(f"{what}: unit ({unit}) and world_size ({world_size}) must be >= 1")
    n_units = -(-size // unit)
    if exact and (size % unit or n_units % world_size):
        raise PlanError(
            f"{what}: size {size} is not {world_size} equal shares of whole {unit}-element units "
            f"({size / unit:g} units) at world_size={world_size}"
        )
    if n_units < world_size:
        raise PlanError(
            f"{what}: size {size} makes only {n_units} share(s) of whole {unit}-element units (the last "
            f"may be short); cannot give each of world_size={world_size} ranks one"
        )
    base, extra = divmod(n_units, world_size)
    out: list[Range] = []
    start = 0
    for r in range(world_size):
        length = min((base + (r < extra)) * unit, size - start)
        out.append((start, length))
        start += length
    return out


def kv_copies(q_shares: list[Range], q_head: int, group: int, kv_head: int) -> list[Range]:
    """KV-head rows each rank needs for its query heads (when world_size exceeds the KV heads).

    Args:
        q_shares: per-rank ``(start, length)`` of query rows (``q_head`` rows per query head).
        q_head: rows per query head; ``group``: query heads per KV head; ``kv_head``: rows per KV head.

    Returns:
        per-rank ``(start, length)`` of KV rows: the contiguous KV heads covering the rank's
        query heads. Neighbouring ranks may share a KV head (each holds a copy).
    """
    out = []
    for start, length in q_shares:
        h0, h1 = start // q_head, (start + length) // q_head
        k0, k1 = h0 // group, -(-h1 // group)
        out.append((k0 * kv_head, (k1 - k0) * kv_head))
    return out


def segmented(segments: tuple[int, ...], per_segment: list[list[Range]]) -> list[tuple[Range, ...]]:
    """Combine per-segment shares into per-rank range lists in the fused tensor's coordinates.

    Args:
        segments: segment sizes along the axis.
        per_segment: ``per_segment[s][r]`` = rank r's ``(start, length)`` within segment s.

    Returns:
        per rank, one ``(start, length)`` per segment, offset into the fused axis.
    """
    offsets = [sum(segments[:s]) for s in range(len(segments))]
    world = len(per_segment[0])
    return [tuple((offsets[s] + per_segment[s][r][0], per_segment[s][r][1]) for s in range(len(segments)))
            for r in range(world)]


def check_block_cuts(ranges: list[tuple[Range, ...]], block: int, size: int, *, what: str, world_size: int) -> None:
    """Refuse shares whose boundaries fall inside a quantization block.

    A boundary is fine when it is a multiple of ``block`` or the axis end (a ragged last block).

    Raises:
        PlanError: naming the tensor and dim (``what``), size, block, world size and the cut.
    """
    if block <= 1:
        return
    for r, rank_ranges in enumerate(ranges):
        for start, length in rank_ranges:
            for cut in (start, start + length):
                if cut % block and cut != size:
                    raise PlanError(
                        f"{what}: size {size} at world_size={world_size} would cut inside a "
                        f"{block}-element quantization block at element {cut} (rank {r}); "
                        f"shares must be whole blocks"
                    )


def lcm(*values: int) -> int:
    """Least common multiple of positive integers."""
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


def natural_key(name: str) -> tuple:
    """Sort key that orders ``layers.2`` before ``layers.10`` (digit runs compared as numbers)."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))
