"""One rank of a tensor-parallel world, run alone: its real kernels at its real shapes, its
collectives counted and priced instead of performed.

A world-size-N pack's rank r holds 1/N of the heads, of every expert's intermediate width and of
the vocabulary. :func:`init_rank_alone` joins a process group of size N whose collectives return at
once without moving data (torch's fake process group), so the rank's model builds and steps on one
device exactly as it would among N ranks, with every reduction skipped. **The values it computes
are not the model's**: the run measures time only. :class:`~shardsmith.runtime.engine.engine.Engine`
refuses such a group, so ``serve`` cannot run on one.

:class:`CollectiveLog` records every collective a step issues (op, bytes of this rank's input,
group size), from the c10d dispatcher: the same calls, in the same order, whether the group is
fake, gloo or NCCL. :func:`collective_seconds` prices them on a :class:`Link`.

Example::

    init_rank_alone(0, 2)
    weights = load_rank_weights(pack, rank=0, world_size=2)
    model, *_ = build_model(weights, rank=0, device=dev, dtype=None, max_seq_len=4096)
    with CollectiveLog() as log:
        model(ids, 0)
    collective_seconds(log.calls, LINKS["nvlink"])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from shardsmith.errors import UsageError

FAKE_BACKEND = "fake"


def init_rank_alone(rank: int, world_size: int) -> None:
    """Join a fake process group as ``rank`` of ``world_size``: collectives return at once and move
    no data (an all-reduce leaves this rank's partial sum, an all-gather leaves the outputs as they were).

    Raises:
        UsageError: a process group already exists, or ``rank`` is not in ``[0, world_size)``.
    """
    if not 0 <= rank < world_size:
        raise UsageError(f"rank {rank} is not in [0, {world_size}) (world_size {world_size})")
    if dist.is_initialized():
        raise UsageError(f"a process group ({dist.get_backend()}, rank {dist.get_rank()} of "
                         f"{dist.get_world_size()}) already exists; rank-alone runs need a process of their own")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=world_size)


def is_rank_alone() -> bool:
    """Whether the default process group is a rank-alone (fake) one."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == FAKE_BACKEND


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as this rank issued it.

    Attributes:
        op: the c10d op (``allreduce``, ``allgather``, ``broadcast``, ...; trailing underscores and
            ``_base`` dropped: ``_allgather_base_`` is ``allgather``).
        nbytes: bytes of this rank's input tensors (an all-gather's output is ``group_size`` times it).
        shape: the first input tensor's shape; dtype: its dtype's name.
        group_size: ranks in the group it ran on.
    """

    op: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    group_size: int


_INPUT_ARG = {"allreduce_": 0, "broadcast_": 0, "allgather_": 1, "_allgather_base_": 1, "reduce_scatter_": 1,
              "_reduce_scatter_base_": 1, "allgather_into_tensor_coalesced_": 1, "allreduce_coalesced_": 0,
              "alltoall_base_": 1, "reduce_": 0, "gather_": 1, "scatter_": 1}


def _tensors(a) -> list[torch.Tensor]:
    if isinstance(a, torch.Tensor):
        return [a]
    if isinstance(a, (list, tuple)):
        return [t for x in a for t in _tensors(x)]
    return []


class CollectiveLog(TorchDispatchMode):
    """Records the collectives run inside ``with CollectiveLog() as log:`` in :attr:`calls`.

    Point-to-point ops, barriers and ``*_object`` collectives (pickled, on the host) appear as the
    c10d ops they issue. Inside a CUDA graph's replay no op is dispatched: count an eager step.
    Every tensor op in the block passes through the mode's Python hook, so time nothing inside it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[CollectiveCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func._opname
            index = _INPUT_ARG.get(name)
            if index is not None:
                inputs = _tensors(args[index])
                group = next((a for a in args if isinstance(a, torch.ScriptObject) and hasattr(a, "size")), None)
                self.calls.append(CollectiveCall(
                    op=name.strip("_").replace("_base", "").replace("_coalesced", "").replace("_into_tensor", ""),
                    nbytes=sum(t.numel() * t.element_size() for t in inputs),
                    shape=tuple(inputs[0].shape) if inputs else (), dtype=str(inputs[0].dtype).removeprefix("torch.") if inputs else "",
                    group_size=int(group.size()) if group is not None else dist.get_world_size()))
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict[str, dict[str, int]]:
        """``{op: {"calls": n, "bytes": total input bytes}}``."""
        out: dict[str, dict[str, int]] = {}
        for c in self.calls:
            s = out.setdefault(c.op, {"calls": 0, "bytes": 0})
            s["calls"] += 1
            s["bytes"] += c.nbytes
        return out


@dataclass(frozen=True)
class Link:
    """A collective's cost model: ``latency_s + wire_bytes / bytes_per_s`` per call, where
    ``wire_bytes`` is what a ring moves per rank (all-reduce ``2 (N-1)/N x bytes``, all-gather
    ``(N-1) x bytes``, broadcast ``bytes``).

    Attributes:
        name; latency_s: one small collective, measured (seconds); bytes_per_s: bus bandwidth;
        source: where the figures come from.
    """

    name: str
    latency_s: float
    bytes_per_s: float
    source: str


LINKS = {
    "nvlink": Link("nvlink", 40e-6, 150e9,
                   "two H200 of one host, NCCL 2.28, NVLink, multicast off: about 40 us per all-reduce from "
                   "14 KB to 1 MB, graphed decode (shardsmith v4_decode h200x2 runs, 2026-11-30); bus "
                   "bandwidth an assumption (messages this small are latency-bound)"),
    "pcie": Link("pcie", 35e-6, 20e9,
                 "two PCIe cards without NVLink: 28.6-41.9 us per 5 KB all-reduce (public report; the middle "
                 "taken); bus bandwidth a PCIe 4.0 x16 card's practical rate"),
}


def collective_seconds(calls: list[CollectiveCall], link: Link) -> float:
    """Seconds ``calls`` take on ``link`` (:class:`Link`'s model), run one after another.

    Raises:
        UsageError: an op the model does not price.
    """
    total = 0.0
    for c in calls:
        n = c.group_size
        if c.op == "allreduce":
            wire = 2 * (n - 1) / n * c.nbytes
        elif c.op == "allgather":
            wire = (n - 1) * c.nbytes
        elif c.op in ("broadcast", "reduce_scatter"):
            wire = c.nbytes
        else:
            raise UsageError(f"no price for the collective {c.op!r} ({c.nbytes} bytes)")
        total += link.latency_s + wire / link.bytes_per_s
    return total
