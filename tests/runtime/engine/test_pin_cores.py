"""Each rank on a host pinned to its own share of the CPUs (``engine/dist.py``: ``core_share``,
``pin_cores``, ``clamp_threads(local_rank=...)``; issue 15: the host expert kernel's threads
partitioned across TP ranks, NUMA-aware).

The share is a pure function of the CPUs, their nodes and physical cores, tested on made-up
topologies (two nodes, SMT siblings, a share that does not divide); the pinning itself runs in real
processes on this machine (skipped where it has fewer CPUs than the ranks), and through the CLI.
"""

from __future__ import annotations

import os

import pytest

from shardsmith.errors import UsageError
from shardsmith.runtime.engine import dist

CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1


def test_two_nodes_two_ranks_take_a_node_each() -> None:
    cpus = list(range(8))
    node = {c: c // 4 for c in cpus}
    core = {c: c for c in cpus}
    assert [dist.core_share(cpus, r, 2, node, core) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [dist.core_share(cpus, r, 4, node, core) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_siblings_of_a_core_stay_with_one_rank() -> None:
    """SMT: CPU c and c + 4 are one physical core (Linux numbers the second threads after the first)."""
    cpus = list(range(8))
    node = {c: 0 for c in cpus}
    core = {c: c % 4 for c in cpus}
    shares = [dist.core_share(cpus, r, 2, node, core) for r in range(2)]
    assert shares == [[0, 4, 1, 5], [2, 6, 3, 7]]
    assert not set(shares[0]) & set(shares[1])


def test_interleaved_node_numbering_and_a_remainder() -> None:
    """Nodes whose CPU ids interleave (even ids node 0, odd node 1) and 7 CPUs for 2 ranks: 3 each,
    node by node, the 7th left to neither."""
    cpus = list(range(7))
    node = {c: c % 2 for c in cpus}
    core = {c: c for c in cpus}
    assert [dist.core_share(cpus, r, 2, node, core) for r in range(2)] == [[0, 2, 4], [6, 1, 3]]


def test_bad_rank_or_too_few_cpus_is_refused() -> None:
    with pytest.raises(ValueError, match="local rank 2 is not in 0 .. 1"):
        dist.core_share([0, 1], 2, 2, {0: 0, 1: 0}, {0: 0, 1: 1})
    with pytest.raises(ValueError, match="1 CPUs for 2 ranks"):
        dist.core_share([0], 0, 2, {0: 0}, {0: 0})


def test_this_hosts_topology_covers_its_cpus() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    node_of, core_of = dist.host_topology(cpus)
    assert set(node_of) == set(core_of) == set(cpus)
    assert all(core_of[c] <= c for c in cpus)  # a core is named by its lowest CPU id


def test_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSMITH_PIN_CORES", "0")
    assert dist.pin_cores(0, 2) is None
    monkeypatch.setenv("SHARDSMITH_PIN_CORES", "on")
    with pytest.raises(UsageError, match="SHARDSMITH_PIN_CORES='on': expected 0 or 1"):
        dist.pin_cores(0, 2)
    monkeypatch.delenv("SHARDSMITH_PIN_CORES")
    assert dist.pin_cores(0, 1) is None  # a single rank keeps every CPU


def _rank(local_rank: int, local_world_size: int, queue) -> None:
    threads = dist.clamp_threads(local_world_size, local_rank=local_rank)
    import torch

    queue.put((local_rank, sorted(os.sched_getaffinity(0)), threads, torch.get_num_threads(),
               dist.clamp_threads()))  # a later call (Engine.load's) keeps the pinned share


@pytest.mark.skipif(CPUS < 2 or not hasattr(os, "sched_setaffinity"), reason="needs 2 CPUs and sched_setaffinity")
def test_two_rank_processes_get_disjoint_cpus() -> None:
    from shardsmith.testing.ranks import rank_context, rank_process

    ctx = rank_context()
    queue = ctx.Queue()
    procs = [rank_process(ctx, _rank, r, 2, queue) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, rest) for r, *rest in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    (cpus0, n0, t0, again0), (cpus1, n1, t1, again1) = got[0], got[1]
    assert not set(cpus0) & set(cpus1)
    assert len(cpus0) == len(cpus1) == n0 == n1 == t0 == t1 == again0 == again1 == CPUS // 2
    assert set(cpus0) | set(cpus1) <= set(os.sched_getaffinity(0))
