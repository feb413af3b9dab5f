"""The slot table and the expert cache's logic on CPU: hits, misses, eviction order, hot set,
capacity edges, and identical decisions on every rank (2 gloo ranks, one routing trace)."""

from __future__ import annotations

import random
import traceback

import pytest
import torch

from shardsmith.errors import UsageError
from shardsmith.runtime.offload.slots import SlotTable, belady, simulate
from shardsmith.testing.ranks import run_ranks


def test_hits_misses_and_lru_order():
    t = SlotTable(3, policy="lru", log=True)
    assert t.admit([(0, 1), (0, 2)]) == ([0, 1], [((0, 1), 0), ((0, 2), 1)])
    assert t.admit([(0, 3)]) == ([2], [((0, 3), 2)])
    assert t.admit([(0, 1)]) == ([0], [])  # hit: (0, 1) becomes most recent
    slots, misses = t.admit([(1, 0)])  # evicts (0, 2), now the least recent
    assert (slots, misses) == ([1], [((1, 0), 1)])
    assert (0, 2) not in t and (0, 1) in t
    assert t.decisions[-1].evicted == (0, 2) and not t.decisions[-1].hit
    assert [d.hit for d in t.decisions] == [False, False, False, True, False]
    assert t.stats() | {} == {"slots": 3, "resident": 3, "hot": 0, "hits": 1, "misses": 4, "evictions": 1,
                              "hit_rate": 0.2}


def test_request_keys_are_never_evicted_by_each_other():
    t = SlotTable(2, policy="lru")
    t.admit([(0, 0), (0, 1)])
    slots, misses = t.admit([(0, 1), (0, 2)])  # must evict (0, 0), not (0, 1) which is in the request
    assert slots == [1, 0] and misses == [((0, 2), 0)]


def test_hot_set_is_pinned():
    t = SlotTable(4, policy="hot", hot_fraction=0.5, refresh=4)
    for _ in range(4):  # (0, 0) and (0, 1) are used every request: they become the hot set
        t.admit([(0, 0), (0, 1)])
    assert t.hot_set == {(0, 0), (0, 1)}
    for e in range(2, 8):  # a scan of cold experts cycles through the two other slots
        t.admit([(1, e)])
    assert (0, 0) in t and (0, 1) in t
    lru = SlotTable(4, policy="lru")
    for _ in range(4):
        lru.admit([(0, 0), (0, 1)])
    for e in range(2, 8):
        lru.admit([(1, e)])
    assert (0, 0) not in lru  # plain LRU lets the scan flush them


def test_hot_set_evicted_only_when_nothing_else_is_left():
    t = SlotTable(2, policy="hot", hot_fraction=0.5, refresh=1)
    t.admit([(0, 0)])
    assert t.hot_set == {(0, 0)}
    slots, _ = t.admit([(0, 1), (0, 2)])  # needs both slots: the hot key must go
    assert (0, 0) not in t and sorted(slots) == [0, 1]


def test_capacity_edges():
    with pytest.raises(UsageError, match="at least 1 slot"):
        SlotTable(0)
    with pytest.raises(UsageError, match="unknown expert cache policy"):
        SlotTable(2, policy="fifo")
    with pytest.raises(UsageError, match="hot_fraction"):
        SlotTable(2, hot_fraction=1.0)
    t = SlotTable(1, policy="hot")
    with pytest.raises(UsageError, match="2 experts requested at once but the cache has 1 slots"):
        t.admit([(0, 0), (0, 1)])
    with pytest.raises(UsageError, match="duplicate"):
        t.admit([(0, 0), (0, 0)])
    for e in (0, 1, 0, 0):  # one slot: every new key evicts the previous one
        t.admit([(0, e)])
    assert t.stats()["hits"] == 1 and t.stats()["evictions"] == 2
    assert t.admit([]) == ([], [])


class _ReferenceTable:
    """The policy as specified, by brute force: scan the whole LRU order for the victim, sort every
    count by ``(-count, key)`` for the hot set (the oracle for :class:`SlotTable`'s O(K) version)."""

    def __init__(self, n: int, hot_fraction: float, refresh: int, decay: int) -> None:
        self.n, self.n_hot, self.refresh, self.decay = n, int(hot_fraction * n), refresh, decay
        self.order: list = []  # least recent first
        self.slot: dict = {}
        self.free = list(range(n - 1, -1, -1))
        self.count: dict = {}
        self.hot: set = set()
        self.requests = 0

    def admit(self, keys: list) -> list:
        for k in keys:
            self.count[k] = self.count.get(k, 0.0) + 1.0
        self.requests += 1
        if self.requests % self.decay == 0:
            self.count = {k: v / 2 for k, v in self.count.items() if v >= 0.5}
        if self.requests % self.refresh == 0 and self.n_hot:
            self.hot = {k for k, _ in sorted(self.count.items(), key=lambda kv: (-kv[1], kv[0]))[: self.n_hot]}
        out = []
        for k in keys:
            if k in self.slot:
                self.order.remove(k)
                self.order.append(k)
                out.append((k, True, self.slot[k], None))
                continue
            victim = None
            if not self.free:
                free = [v for v in self.order if v not in keys]
                victim = next((v for v in free if v not in self.hot), free[0])
                self.order.remove(victim)
            slot = self.slot.pop(victim) if victim is not None else self.free.pop()
            self.slot[k] = slot
            self.order.append(k)
            out.append((k, False, slot, victim))
        return out


@pytest.mark.parametrize("slots,hot_fraction", [(4, 0.5), (40, 0.75), (200, 0.25)])
def test_hot_policy_matches_the_brute_force_reference(slots, hot_fraction):
    """Same hits, slots and victims as the specification on a skewed multi-layer trace with decay."""
    rng = random.Random(slots)
    weights = [1 / (i + 1) for i in range(64)]
    trace = [[(layer, e) for e in sorted(set(rng.choices(range(64), weights, k=6)))]
             for _ in range(300) for layer in range(8)]
    table = SlotTable(slots, policy="hot", hot_fraction=hot_fraction, refresh=7, decay=50, log=True)
    ref = _ReferenceTable(slots, hot_fraction, refresh=7, decay=50)
    for req in trace:
        for i in range(0, len(req), slots):
            table.admit(req[i: i + slots])
            want = ref.admit(req[i: i + slots])
            got = [(d.key, d.hit, d.slot, d.evicted) for d in table.decisions[-len(want):]]
            assert got == want
    assert table.hot_set == ref.hot and table.evictions > 0


def test_simulated_rates_are_bounded_by_belady():
    rng = random.Random(0)
    trace = [[(layer, e) for e in rng.sample(range(16), 2)] for _ in range(100) for layer in range(4)]
    opt = belady(trace, 16)
    for policy in ("lru", "hot"):
        assert 0 < simulate(trace, 16, policy=policy) <= opt
    assert simulate(trace, 64, policy="lru") == belady(trace, 64)  # everything fits: only cold misses


def _trace(seed: int, steps: int, layers: int, experts: int, k: int) -> list[list[tuple[int, int]]]:
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(experts)]  # Zipf(1)
    out = []
    for _ in range(steps):
        for layer in range(layers):
            picked: list[int] = []
            while len(picked) < k:
                e = rng.choices(range(experts), weights)[0]
                if e not in picked:
                    picked.append(e)
            out.append([(layer, e) for e in sorted(picked)])
    return out




def _rank_main(rank: int, world_size: int, port: int, pack: str, queue) -> None:
    try:
        import torch.distributed as dist

        from shardsmith.runtime.engine.engine import Engine, SamplingParams
        from shardsmith.runtime.offload import OffloadConfig
        from shardsmith.runtime.engine.dist import init_distributed

        init_distributed(rank, world_size, master_port=port)
        logs = {}
        for policy in ("lru", "hot"):
            cfg = OffloadConfig(backend="gpu", cache_slots=5, policy=policy, log_decisions=True, probe=False)
            eng = Engine.load(pack, rank=rank, world_size=world_size, dtype=torch.float32, max_seq_len=64, offload=cfg)
            if rank == 0:
                list(eng.generate([3, 17, 42, 99, 5], SamplingParams(max_tokens=12)))
                eng.shutdown()
            else:
                eng.follow()
            mine = [(d.key, d.hit, d.slot, d.evicted) for d in eng.offload.cache.table.decisions]
            every: list = [None] * world_size
            dist.all_gather_object(every, mine)
            logs[policy] = every
        # a synthetic trace through bare slot tables, no model
        table = SlotTable(7, policy="hot", hot_fraction=0.5, refresh=8, log=True)
        for req in _trace(1, 50, 3, 16, 4):
            table.admit(req)
        every = [None] * world_size
        dist.all_gather_object(every, [(d.key, d.hit, d.slot, d.evicted) for d in table.decisions])
        logs["trace"] = every
        if rank == 0:
            queue.put(("ok", logs))
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


def test_every_rank_makes_the_same_decisions(tmp_path):
    from shardsmith.testing import tiny_mixtral
    from shardsmith.writer.split import split_checkpoint

    src = tiny_mixtral(tmp_path / "src", experts=8)
    pack = tmp_path / "tp2"
    split_checkpoint(src, pack, world_size=2)
    logs = run_ranks(_rank_main, 2, str(pack), timeout=180)
    for name, (r0, r1) in logs.items():
        assert len(r0) > 20, name
        assert r0 == r1, f"{name}: ranks disagree"
        assert any(hit for _, hit, _, _ in r0) and any(ev for *_, ev in r0), name  # hits and evictions both happened
