"""Rank cuts, expert-bank arrays and what each rank holds: pure arithmetic over the resolved plan.

Used by ``split`` (to lay files out), by ``verify`` and the pack reader (to recompute what a rank
must hold) and by the runtime (``Shards.bank_shape``, the ``--from-checkpoint`` loader), so none of
them needs the writer. Bank layout (``manifests/README.md``, bank files; one bank per MoE layer per
rank; ``E`` experts, ``I_r`` the rank's share of the intermediate dim, ``H`` hidden, in stored
elements of the source dtype):

================  ==========================  ==============================================
array             shape                       contents
================  ==========================  ==============================================
gate_up           ``[E, 2*I_r, H]``           rows ``[0, I_r)`` gate (w1), ``[I_r, 2*I_r)`` up (w3)
gate_up_scale     ``[E, 2*S_r, H_s]``         the two scale shards stacked the same way
down              ``[E, H, I_r]``             the down (w2) shard
down_scale        ``[E, H_s, I_s]``           its scale shard
================  ==========================  ==============================================

Expert ``e``'s segment ``s`` starts at byte ``(e * n_segments + s) * slot_nbytes`` of its array;
arrays sit in a bank file in :data:`BANK_ORDER`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardsmith.checkpoint.reader import slice_bytes
from shardsmith.errors import PlanError
from shardsmith.pack.format import Entry
from shardsmith.plans.core import natural_key
from shardsmith.plans.resolve import ResolvedPlan, TensorPlan

BANK_ORDER = ("gate_up", "gate_up_scale", "down", "down_scale")


def cut(raw: np.ndarray, tp: TensorPlan, rank: int) -> np.ndarray:
    """Rank ``rank``'s shard of a tensor as contiguous bytes.

    Args:
        raw: the whole source tensor's bytes (``uint8``, ``nbytes`` long; a memmap is fine).
        tp: the tensor's plan.

    Returns:
        ``uint8`` array of ``tp.local_nbytes(rank)`` bytes in its own storage (never a view of
        ``raw``), laid out as the rank-local shape ``tp.local_shape(rank)``.
    """
    if tp.shard_dim is None:
        return np.array(raw, dtype=np.uint8, copy=True)
    parts = [slice_bytes(raw, tp.dtype, tp.shape, tp.shard_dim, s, n, name=tp.name) for s, n in tp.ranges[rank]]
    if len(parts) == 1:
        return np.array(parts[0], dtype=np.uint8, order="C", copy=True).reshape(-1)
    return np.concatenate(parts, axis=1).reshape(-1)  # a fresh array


@dataclass(frozen=True, slots=True)
class BankArraySpec:
    """One array of one layer's expert bank on one rank.

    Attributes:
        layer: layer key (``layers.3``); name: ``gate_up``, ``down``, ``gate_up_scale``, ``down_scale``.
        dtype: safetensors dtype of the source tensors; shape: ``[E, rows, cols]`` in stored elements.
        slot_nbytes: bytes of one (expert, segment) shard; n_segments: 2 for gate_up, 1 for down.
        members: source tensor name per ``(expert, segment)``.
    """

    layer: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    slot_nbytes: int
    n_segments: int
    members: dict[tuple[int, int], str]

    @property
    def nbytes(self) -> int:
        """Bytes of the whole array."""
        return self.slot_nbytes * self.n_segments * self.shape[0]

    def slot_offset(self, expert: int, segment: int) -> int:
        """Byte offset of ``(expert, segment)`` inside the array."""
        return (expert * self.n_segments + segment) * self.slot_nbytes


def bank_specs(plan: ResolvedPlan, rank: int) -> dict[str, list[BankArraySpec]]:
    """The expert-bank arrays of rank ``rank``, per layer key in natural order.

    Raises:
        PlanError: experts of one layer whose shards differ in dtype or shape.
    """
    groups: dict[tuple[str, str], list[TensorPlan]] = {}
    for tp in plan.tensors.values():
        if tp.bank is not None:
            groups.setdefault((tp.bank.layer, tp.bank.array_name), []).append(tp)
    out: dict[str, list[BankArraySpec]] = {}
    for (layer, name), tps in sorted(groups.items(), key=lambda kv: (natural_key(kv[0][0]), kv[0][1])):
        first = tps[0]
        shape = first.local_shape(rank)
        n_seg = 1 + max(tp.bank.segment for tp in tps)
        for tp in tps:
            if tp.dtype != first.dtype or tp.local_shape(rank) != shape:
                raise PlanError(
                    f"{layer} bank {name}: {tp.name} is {tp.dtype}{list(tp.local_shape(rank))} on rank {rank} "
                    f"but {first.name} is {first.dtype}{list(shape)}; all experts of a layer must match"
                )
        members = {(tp.bank.expert, tp.bank.segment): tp.name for tp in tps}
        n_exp = plan.experts[layer]
        bank_shape = (n_exp, shape[0] * n_seg, *shape[1:])
        spec = BankArraySpec(layer, name, first.dtype, bank_shape, first.local_nbytes(rank), n_seg, members)
        out.setdefault(layer, []).append(spec)
    return out


def expected_entries(plan: ResolvedPlan, rank: int) -> tuple[dict[str, Entry], dict[str, list[Entry]]]:
    """What rank ``rank`` must hold, from the plan alone.

    Returns:
        ``(dense, banks)``: dense entries by source name (checkpoint order), and per layer key the
        bank arrays in :data:`BANK_ORDER` (shapes ``[E, rows, cols]`` in stored elements).

    Raises:
        PlanError: as :func:`bank_specs`.
    """
    dense = {n: Entry(n, tp.dtype, tp.local_shape(rank), tp.local_nbytes(rank))
             for n, tp in plan.tensors.items() if tp.bank is None}
    banks = {}
    for layer, specs in bank_specs(plan, rank).items():
        specs = sorted(specs, key=lambda s: BANK_ORDER.index(s.name))
        banks[layer] = [Entry(s.name, s.dtype, s.shape, s.nbytes) for s in specs]
    return dense, banks


# Stacked experts (gpt-oss): the source already holds each layer's experts as ``[E, ...]`` tensors,
# which the plan splits TP-within-expert and the writer stores in the dense files with their
# rank-local shapes. A rank's shard of such a tensor is contiguous per expert, so it *is* a bank
# array once viewed in the bank's stored format; nothing is rewritten. Source suffix -> bank array:
STACKED_ARRAYS = (
    ("gate_up_proj_blocks", "gate_up"),
    ("gate_up_proj_scales", "gate_up_scale"),
    ("gate_up_proj_bias", "gate_up_bias"),
    ("down_proj_blocks", "down"),
    ("down_proj_scales", "down_scale"),
)
STACKED_INFIX = ".mlp.experts."


@dataclass(frozen=True, slots=True)
class StackedArraySpec:
    """One bank array of a layer whose experts are stacked source tensors (gpt-oss), on one rank.

    Attributes:
        layer: bank layer key (``model.layers.3``); name: bank array (``gate_up``, ``gate_up_scale``,
            ``gate_up_bias``, ``down``, ``down_scale``); source: the dense tensor holding it.
        dtype, shape: the bank view of the source shard's bytes: MXFP4 blocks U8 ``[E, R, K/32, 16]``
            -> ``I8 [E, R, K/2]`` (two e2m1 codes per byte, low nibble first, the FP4 bank format),
            E8M0 scales U8 ``[E, R, K/32]`` -> ``F8_E8M0``, the bias as stored. ``gate_up`` rows stay
            interleaved (row ``2j`` gate channel ``j``, ``2j + 1`` up channel ``j``).
        nbytes: bytes of the rank's shard (the same bytes either way).
    """

    layer: str
    name: str
    source: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def stacked_bank_specs(plan: ResolvedPlan, rank: int) -> dict[str, list[StackedArraySpec]]:
    """Rank ``rank``'s expert banks over stacked expert tensors (gpt-oss), per layer key in natural order.

    A layer counts when its experts are planned TP-within-expert as whole ``[E, ...]`` tensors (no
    per-expert bank slots) named ``<layer>.mlp.experts.<suffix>`` with every suffix of
    :data:`STACKED_ARRAYS`; the down bias is not an expert array (it is added once, after the
    all-reduce). Empty for every other family.

    Raises:
        PlanError: a layer with some of the stacked arrays but not all, or MXFP4 blocks that are
            not ``U8 [E, R, K/32, 16]``.
    """
    found: dict[str, dict[str, TensorPlan]] = {}
    suffixes = dict(STACKED_ARRAYS)
    for name, tp in plan.tensors.items():
        layer, infix, suffix = name.partition(STACKED_INFIX)
        if infix and suffix in suffixes and tp.bank is None and tp.shard_dim is not None:
            found.setdefault(layer, {})[suffix] = tp
    out: dict[str, list[StackedArraySpec]] = {}
    for layer in sorted(found, key=natural_key):
        tps = found[layer]
        missing = [s for s, _ in STACKED_ARRAYS if s not in tps]
        if missing:
            raise PlanError(f"{layer}: stacked experts lack {', '.join(f'{layer}{STACKED_INFIX}{s}' for s in missing)}")
        specs = []
        for suffix, array in STACKED_ARRAYS:
            tp = tps[suffix]
            shape, dtype = tp.local_shape(rank), tp.dtype
            if suffix.endswith("_blocks"):
                if dtype != "U8" or len(shape) != 4 or shape[-1] != 16:
                    raise PlanError(f"{tp.name}: MXFP4 blocks must be U8 [E, R, K/32, 16], got {dtype}{list(shape)}")
                shape, dtype = (*shape[:2], shape[2] * shape[3]), "I8"
            elif suffix.endswith("_scales"):
                dtype = "F8_E8M0"
            specs.append(StackedArraySpec(layer, array, tp.name, dtype, shape, tp.local_nbytes(rank)))
        out[layer] = specs
    return out
