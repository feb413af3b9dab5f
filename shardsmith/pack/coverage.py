"""Plan coverage: recheck, from ``plan.json`` alone, that every tensor's shards cover it exactly.

Rules checked per tensor (``W`` ranks, ``D`` the size of the shard dim):

- replicated: every rank's range is the whole of dim 0 (``(0, 1)`` for a scalar);
- split by units (``front-loaded-units`` / ``equal-units``): the ranges taken segment by segment,
  rank by rank, tile ``[0, D)`` exactly once and in order (each starts where the previous ended);
- ``kv-copies``: each rank holds one range of whole KV heads (start and length multiples of the
  unit), starts never decrease with rank, and together they cover ``[0, D)``; neighbours may
  overlap, but only on whole heads.
"""

from __future__ import annotations

from shardsmith.dtypes import DTYPES
from shardsmith.plans.core import Split
from shardsmith.plans.resolve import ResolvedPlan, TensorPlan


def _is_int(x: object, lo: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo


_TENSOR_KEYS = {"dtype": str, "shape": list, "layout": str, "rule": int, "shard_dim": (int, type(None)), "unit": int,
                "partition": str, "quant": str, "ranges": list, "scale_of": str, "bank": dict, "block": list}
_OPTIONAL = {"scale_of", "bank", "quant", "block"}  # block: written since plans keep it (plans/serialize.py)


def json_problems(data: object) -> list[str]:
    """JSON types of ``plan.json`` (``manifests/README.md``), checked before the plan is rebuilt: the
    rebuild coerces (``int("2")``), so a value of another type must be named here, not accepted."""
    def typed(v: object, t) -> bool:
        return isinstance(v, t) and not (isinstance(v, bool) and t is not bool)

    if not isinstance(data, dict):
        return [f"plan.json: expected a JSON object, found {type(data).__name__}"]
    out = []
    for key, t in (("family", str), ("world_size", int), ("align", int), ("notes", list), ("experts", dict), ("tensors", dict)):
        if not typed(data.get(key), t):
            out.append(f"plan.json: field {key}: expected {t.__name__}, found {data.get(key)!r:.60}")
    if out:
        return out
    if extra := sorted(set(data) - {"family", "world_size", "align", "notes", "experts", "tensors"}):
        out.append(f"plan.json: unknown keys {extra}")
    out += [f"plan.json: field experts.{k}: expected a count, found {v!r:.40}" for k, v in data["experts"].items() if not typed(v, int)]
    for name, d in data["tensors"].items():
        where = f"plan.json: tensor {name!r}"
        if not isinstance(d, dict):
            out.append(f"{where}: expected an object, found {d!r:.40}")
            continue
        for key in sorted(set(_TENSOR_KEYS) | set(d)):
            if key not in _TENSOR_KEYS:
                out.append(f"{where}: unknown key {key!r:.40}")
            elif key not in d:
                if key not in _OPTIONAL:
                    out.append(f"{where}: field {key} missing")
            elif not typed(d[key], _TENSOR_KEYS[key]):
                out.append(f"{where}: field {key}: {d[key]!r:.40} has the wrong type")
        ranges = d.get("ranges")
        if isinstance(ranges, list) and not all(
                isinstance(rr, list) and all(isinstance(r, list) and len(r) == 2 and all(typed(x, int) for x in r) for r in rr)
                for rr in ranges):
            out.append(f"{where}: field ranges: not a list per rank of [start, length] integer pairs")
        block = d.get("block")
        if isinstance(block, list) and not (len(block) == 2 and all(_is_int(b, 1) for b in block)):
            out.append(f"{where}: field block: {block!r:.40} is not [rows, cols] of positive integers")
        bank = d.get("bank")
        if isinstance(bank, dict) and not (typed(bank.get("layer"), str) and typed(bank.get("expert"), int)
                                           and typed(bank.get("segment"), int) and typed(bank.get("scale"), bool)
                                           and typed(bank.get("array"), str) and len(bank) == 5):
            out.append(f"{where}: field bank: {bank!r:.80} is not {{layer, expert, array, segment, scale}}")
    return out


def value_problems(tp: TensorPlan) -> list[str]:
    """Values of one tensor's plan that no arithmetic may use: an unknown dtype, a shape or range that
    is not non-negative integers, a ``shard_dim`` outside the shape, a unit below 1."""
    where = f"plan.json: tensor {tp.name!r}"
    if tp.dtype not in DTYPES:
        return [f"{where}: dtype {tp.dtype!r:.40} is not a safetensors dtype"]
    if not all(_is_int(d) for d in tp.shape) or len(tp.shape) > 8:
        return [f"{where}: shape {list(tp.shape)!r:.80} is not a list of at most 8 non-negative integers"]
    if tp.shard_dim is not None and not (_is_int(tp.shard_dim) and tp.shard_dim < len(tp.shape)):
        return [f"{where}: shard_dim {tp.shard_dim!r:.40} outside shape {list(tp.shape)}"]
    if not _is_int(tp.unit, 1):
        return [f"{where}: unit {tp.unit!r:.40} is not a positive integer"]
    if not all(_is_int(s) and _is_int(n) for rr in tp.ranges for s, n in rr):
        return [f"{where}: ranges hold a value that is not a non-negative integer"]
    if tp.bank is not None and not (_is_int(tp.bank.expert) and tp.bank.segment in (0, 1)):
        return [f"{where}: bank slot expert {tp.bank.expert!r:.20} segment {tp.bank.segment!r:.20} out of range"]
    return []


def tensor_problems(tp: TensorPlan, world_size: int) -> list[str]:
    """Coverage problems of one tensor's ranges (empty when they tile its axis as required)."""
    where = f"plan.json: tensor {tp.name!r}"
    if len(tp.ranges) != world_size:
        return [f"{where}: ranges for {len(tp.ranges)} ranks, expected {world_size}"]
    if tp.shard_dim is None:
        whole = ((0, tp.shape[0] if tp.shape else 1),)
        return [f"{where}: replicated, rank {r} range {list(map(list, rr))} expected {list(map(list, whole))}"
                for r, rr in enumerate(tp.ranges) if tuple(rr) != whole][:1]
    if not 0 <= tp.shard_dim < len(tp.shape):
        return [f"{where}: shard_dim {tp.shard_dim} outside shape {list(tp.shape)}"]
    size = tp.shape[tp.shard_dim]
    axis = f"dim {tp.shard_dim} [0, {size})"
    if tp.split is Split.KV_COPIES:
        out, reach, prev = [], 0, -1
        for r, rr in enumerate(tp.ranges):
            if len(rr) != 1:
                return [f"{where}: kv-copies rank {r} has {len(rr)} ranges, expected 1"]
            s, n = rr[0]
            if s % tp.unit or n % tp.unit or n <= 0 or s + n > size:
                out.append(f"{where}: kv-copies rank {r} range [{s}, {s + n}) is not whole {tp.unit}-element heads inside {axis}")
            if s < prev or s > reach:
                out.append(f"{where}: kv-copies rank {r} starts at {s}: expected in [{max(prev, 0)}, {reach}] (ordered, no gap)")
            prev, reach = s, max(reach, s + n)
        if reach != size:
            out.append(f"{where}: kv-copies cover [0, {reach}) of {axis}")
        return out
    n_seg = len(tp.ranges[0])
    if any(len(rr) != n_seg for rr in tp.ranges):
        return [f"{where}: ranks hold different numbers of segments {[len(rr) for rr in tp.ranges]}"]
    pos = 0
    for seg in range(n_seg):
        for r in range(world_size):
            s, n = tp.ranges[r][seg]
            if s != pos or n < 0:
                return [f"{where}: ranges do not tile {axis}: rank {r} segment {seg} is [{s}, {s + n}), expected to start at {pos}"]
            pos += n
    if pos != size:
        return [f"{where}: ranges cover [0, {pos}) of {axis}"]
    return []


def plan_problems(plan: ResolvedPlan) -> list[str]:
    """Value and coverage problems of every tensor of ``plan`` and of its expert banks.

    An empty list means the plan's arithmetic (local shapes, bank specs, cuts) is safe to run.
    """
    from shardsmith.errors import PlanError
    from shardsmith.pack.banks import bank_specs

    out = [p for tp in plan.tensors.values() for p in value_problems(tp)]
    if out:
        return out
    out = [p for tp in plan.tensors.values() for p in tensor_problems(tp, plan.world_size)]
    for tp in plan.tensors.values():
        if tp.bank and tp.bank.layer not in plan.experts:
            out.append(f"plan.json: tensor {tp.name!r} in bank {tp.bank.layer!r}, which has no expert count")
        elif tp.bank and not tp.bank.expert < plan.experts[tp.bank.layer]:
            out.append(f"plan.json: tensor {tp.name!r} is expert {tp.bank.expert} of bank {tp.bank.layer!r}, "
                       f"which has {plan.experts[tp.bank.layer]} experts")
    members: dict[tuple[str, str], set[tuple[int, int]]] = {}
    for tp in plan.tensors.values():
        if tp.bank and tp.bank.layer in plan.experts:
            members.setdefault((tp.bank.layer, tp.bank.array_name), set()).add((tp.bank.expert, tp.bank.segment))
    for (layer, array), have in sorted(members.items()):
        n_seg = 1 + max(s for _, s in have)
        lost = sorted({(e, s) for e in range(plan.experts[layer]) for s in range(n_seg)} - have)
        if lost:
            out.append(f"plan.json: bank {layer!r} array {array!r} has no source tensor for (expert, segment) "
                       f"{lost[:4]}{' ...' if len(lost) > 4 else ''}")
    if not out:
        for r in range(plan.world_size):
            try:
                bank_specs(plan, r)
            except PlanError as e:
                out.append(f"plan.json: {e}")
    return out
