"""Which expert sits in which cache slot: a deterministic slot table with two eviction policies.

Every rank runs its own :class:`SlotTable` over the same sequence of requests (the router is
replicated, so every rank sees the same selected experts in the same order) and therefore makes
the same hit/miss/eviction decisions with no communication. Nothing here depends on timing, thread
scheduling, hash seeds or the rank: ties are broken by key.

==========  ==============================================================================
policy      eviction victim
==========  ==============================================================================
``lru``     the least recently used key not needed by the current request
``hot``     as ``lru``, but the ``hot_fraction * slots`` keys with the highest (decayed)
            access counts are pinned and never evicted; the hot set is recomputed every
            ``refresh`` requests, counts halve every ``decay`` requests (adapts to drift)
==========  ==============================================================================

A key is ``(layer_index, expert)``. Legend: S = slots.

Example:
    >>> t = SlotTable(2, policy="lru")
    >>> t.admit([(0, 3), (0, 5)])
    ([0, 1], [((0, 3), 0), ((0, 5), 1)])
    >>> t.admit([(1, 0)])  # evicts (0, 3), the least recently used
    ([0], [((1, 0), 0)])
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass

from ...errors import UsageError

Key = tuple[int, int]


class Policy(str, enum.Enum):
    """Eviction policy of a :class:`SlotTable`."""

    LRU = "lru"
    HOT = "hot"


@dataclass(frozen=True, slots=True)
class Decision:
    """One key of one request: ``hit`` or not, the slot it occupies, the key it evicted (if any)."""

    key: Key
    hit: bool
    slot: int
    evicted: Key | None


class SlotTable:
    """Map expert keys to ``n_slots`` slots; deterministic, host-side, O(K) per eviction (K keys per request).

    Args:
        n_slots: S, slots in the pool (>= 1).
        policy: ``lru`` or ``hot`` (:class:`Policy`).
        hot_fraction: share of slots pinned to the most frequently used keys (``hot`` only), in [0, 1).
        refresh: requests between hot-set recomputations; decay: requests between halving counts.
        log: keep every :class:`Decision` in :attr:`decisions` (tests, cross-rank comparison).

    Raises:
        UsageError: ``n_slots < 1``, an unknown policy or a hot fraction outside [0, 1).
    """

    def __init__(self, n_slots: int, *, policy: Policy | str = Policy.HOT, hot_fraction: float = 0.75,
                 refresh: int = 64, decay: int = 4096, log: bool = False) -> None:
        if n_slots < 1:
            raise UsageError(f"an expert cache needs at least 1 slot, got {n_slots}")
        try:
            self.policy = Policy(policy)
        except ValueError:
            raise UsageError(f"unknown expert cache policy {policy!r} (choose: lru, hot)") from None
        if not 0 <= hot_fraction < 1:
            raise UsageError(f"hot_fraction must be in [0, 1), got {hot_fraction}")
        self.n_slots, self.refresh, self.decay = n_slots, max(1, refresh), max(1, decay)
        self.n_hot = int(hot_fraction * n_slots) if self.policy is Policy.HOT else 0
        self._lru: OrderedDict[Key, int] = OrderedDict()  # key -> slot, least recent first
        self._cold: OrderedDict[Key, None] = OrderedDict()  # resident keys outside the hot set, same order
        # (kept only when there is a hot set; without one every resident key is cold and _lru is the order)
        self._free = list(range(n_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._count: dict[Key, float] = {}
        self._hot: frozenset[Key] = frozenset()
        self._requests = 0
        self.hits = self.misses = self.evictions = 0
        self.decisions: list[Decision] | None = [] if log else None

    def __contains__(self, key: Key) -> bool:
        return key in self._lru

    def slot_of(self, key: Key) -> int | None:
        """The slot holding ``key``, or None; no side effects."""
        return self._lru.get(key)

    def items(self) -> list[tuple[Key, int]]:
        """``(key, slot)`` of every resident key; no side effects."""
        return list(self._lru.items())

    @property
    def hot_set(self) -> frozenset[Key]:
        """Keys currently pinned (``hot`` policy)."""
        return self._hot

    def admit(self, keys: list[Key]) -> tuple[list[int], list[tuple[Key, int]]]:
        """Make every key of one request resident; all of them stay resident until the next request.

        Args:
            keys: distinct keys, at most ``n_slots`` of them (callers split larger requests into waves).

        Returns:
            ``(slots, misses)``: the slot of each key in order, and ``(key, slot)`` for each key that
            was not resident and must be filled (in request order).

        Raises:
            UsageError: duplicate keys or more keys than slots.
        """
        if len(set(keys)) != len(keys):
            raise UsageError(f"duplicate keys in one cache request: {keys}")
        if len(keys) > self.n_slots:
            raise UsageError(f"{len(keys)} experts requested at once but the cache has {self.n_slots} slots; "
                             "split the request into waves of at most n_slots")
        self._tick(keys)
        needed = set(keys)
        slots, misses = [], []
        for key in keys:
            slot = self._lru.get(key)
            if slot is not None:
                self._lru.move_to_end(key)
                if self.n_hot and key in self._cold:
                    self._cold.move_to_end(key)
                self.hits += 1
                hit, evicted = True, None
            else:
                self.misses += 1
                hit, evicted = False, None
                if self._free:
                    slot = self._free.pop()
                else:
                    evicted = self._victim(needed)
                    slot = self._lru.pop(evicted)
                    self._cold.pop(evicted, None)
                    self.evictions += 1
                self._lru[key] = slot
                if self.n_hot and key not in self._hot:
                    self._cold[key] = None
                misses.append((key, slot))
            slots.append(slot)
            if self.decisions is not None:
                self.decisions.append(Decision(key, hit, slot, evicted))
        return slots, misses

    def _victim(self, needed: set[Key]) -> Key:
        """Least recently used key outside the request, preferring keys outside the hot set.

        O(K) for K keys in the request: the non-hot resident keys are kept in their own LRU order.
        """
        for key in self._cold if self.n_hot else ():  # least recent first
            if key not in needed:
                return key
        for key in self._lru:  # every resident key outside the request is hot
            if key not in needed:
                return key
        raise UsageError("no evictable slot")  # cannot happen while len(keys) <= n_slots

    def _tick(self, keys: list[Key]) -> None:
        if self.policy is not Policy.HOT:
            return
        for key in keys:
            self._count[key] = self._count.get(key, 0.0) + 1.0
        self._requests += 1
        if self._requests % self.decay == 0:
            self._count = {k: v / 2 for k, v in self._count.items() if v >= 0.5}
        if self._requests % self.refresh == 0 and self.n_hot:
            self._hot = top_keys(self._count, self.n_hot)
            self._cold = OrderedDict((k, None) for k in self._lru if k not in self._hot)

    def stats(self) -> dict[str, float]:
        """Counters: ``slots``, ``resident``, ``hot``, ``hits``, ``misses``, ``evictions``, ``hit_rate``."""
        total = self.hits + self.misses
        return {"slots": self.n_slots, "resident": len(self._lru), "hot": len(self._hot), "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions, "hit_rate": self.hits / total if total else 0.0}


def top_keys(count: dict[Key, float], n: int) -> frozenset[Key]:
    """The ``n`` keys with the highest counts, ties broken by the smaller key (as sorting by
    ``(-count, key)`` would), in O(N log N) on the counts alone plus a sort of the tied keys."""
    if n >= len(count):
        return frozenset(count)
    threshold = sorted(count.values(), reverse=True)[n - 1]
    above = [k for k, v in count.items() if v > threshold]
    tied = sorted(k for k, v in count.items() if v == threshold)
    return frozenset(above + tied[: n - len(above)])


def simulate(trace: list[list[Key]], n_slots: int, *, policy: Policy | str, **kw) -> float:
    """Hit rate of ``policy`` with ``n_slots`` slots over ``trace`` (a list of requests)."""
    t = SlotTable(n_slots, policy=policy, **kw)
    for req in trace:
        for i in range(0, len(req), n_slots):
            t.admit(req[i: i + n_slots])
    return t.stats()["hit_rate"]


def belady(trace: list[list[Key]], n_slots: int) -> float:
    """Hit rate of Belady's offline optimum (evict the key used furthest in the future): an upper bound."""
    flat = [k for req in trace for k in req]
    nxt: list[int] = [0] * len(flat)
    seen: dict[Key, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        nxt[i] = seen.get(flat[i], len(flat) + i)
        seen[flat[i]] = i
    resident: dict[Key, int] = {}  # key -> next use
    hits = 0
    for i, k in enumerate(flat):
        if k in resident:
            hits += 1
        elif len(resident) >= n_slots:
            del resident[max(resident, key=resident.__getitem__)]
        resident[k] = nxt[i]
    return hits / len(flat) if flat else 0.0
