"""Prefix reuse across requests: a finished sequence's slot keeps its state, and a later prompt
that begins with the same tokens starts its prefill where they end.

Every family keeps one sequence per slot (:mod:`shardsmith.runtime.models.seq_slots`), its state
preallocated for ``max_seq_len`` positions. When a sequence leaves, its slot is not cleared: it
still holds the keys and values (DeepSeek-V3's latents, V4's window ring, compressors and indexer)
of the tokens it was fed, positions ``0 .. n-1``. :class:`PrefixCache` remembers those tokens per
free slot and, for a new prompt, picks the free slot whose held tokens share the longest prefix
with it; the prompt's prefill then starts at that prefix's end instead of 0, and the slot's older
positions past it are overwritten. This is the per-slot prompt cache of llama.cpp's server
(``cache_prompt``) rather than vLLM's hashed KV blocks: with a slot per sequence, a conversation's
next turn, which resends the history and adds to it, finds its previous turn's slot.

Which prefixes a family can resume (``rewinds``, :class:`~shardsmith.runtime.models.registry.ModelFamily`):

- position-indexed caches (the Mixtral family, DeepSeek-V3, gpt-oss): any prefix; a step at
  position ``k`` attends positions ``< k`` and overwrites from ``k``.
- DeepSeek-V4 (its window ring and compressor state cannot rewind): the slot's whole history (the
  new prompt extends every token the slot was fed, as a conversation's next turn does when its
  template renders the earlier turns as they were generated), else the last **resume point** within
  the shared prefix: its prefills leave a snapshot of that state every ``snapshot_every`` tokens
  (``DeepseekV4.restore``), so a template that rewrites an earlier turn (dropping its reasoning)
  still resumes at the last snapshot before the change.

At least one prompt token is always computed (its logits choose the first new token). The logits
of a resumed prompt equal those of a prefill from 0 up to the rounding of a different chunking,
as chunked prefill's do. Slots that hold nothing are used first; otherwise a new prompt with no
shared prefix takes the least recently used free slot, dropping what it held.

Legend: P = prompt tokens, H = tokens a slot holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["PrefixCache", "PrefixStats", "shared_prefix"]


def shared_prefix(held: Sequence[int], prompt: Sequence[int]) -> int:
    """Length of the longest common prefix of ``held`` and ``prompt`` (tokens)."""
    m = min(len(held), len(prompt))
    if m == 0:
        return 0
    a = np.asarray(held[:m], dtype=np.int64)
    b = np.asarray(prompt[:m], dtype=np.int64)
    diff = np.flatnonzero(a != b)
    return int(diff[0]) if diff.size else m


@dataclass
class PrefixStats:
    """Counters since start. Attributes: queries: prompts looked up; hits: prompts that resumed a
    prefix; query_tokens: their prompt tokens; hit_tokens: prompt tokens not computed (reused).
    A preempted sequence that resumes (its prompt and the tokens it had fed looked up again) is
    counted apart, as vLLM does: preempted_queries, preempted_query_tokens, preempted_hit_tokens."""

    queries: int = 0
    hits: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    preempted_queries: int = 0
    preempted_query_tokens: int = 0
    preempted_hit_tokens: int = 0


class PrefixCache:
    """The tokens each free slot holds, and the choice of a slot for a new prompt.

    Args:
        n_slots: the engine's ``max_num_seqs``.
        rewinds: the family resumes any prefix of a slot's history (module docstring); False: the
            whole history, or one of ``resume_points(slot)``.
        enabled: False: every prompt starts at 0 in the lowest free slot (nothing is kept).
        resume_points: positions a slot that cannot rewind can go back to (ascending), or None.
    """

    def __init__(self, n_slots: int, *, rewinds: bool, enabled: bool = True,
                 resume_points: Callable[[int], list[int]] | None = None) -> None:
        self.rewinds, self.enabled, self.resume_points = rewinds, enabled, resume_points
        self.held: list[tuple[int, ...]] = [()] * n_slots  # tokens at positions 0..H-1 of each free slot
        self._used = [0] * n_slots  # when each slot was last released (a counter; 0: never)
        self._clock = 0
        self.stats = PrefixStats()

    def keep(self, slot: int, tokens: Sequence[int]) -> None:
        """``slot``'s sequence left holding ``tokens`` at positions ``0 .. len(tokens)-1``."""
        self._clock += 1
        self._used[slot] = self._clock
        self.held[slot] = tuple(tokens) if self.enabled else ()

    def reusable(self, slot: int, prompt: Sequence[int]) -> int:
        """Prompt tokens ``slot`` can skip (0 .. P-1): the shared prefix, or for a family that
        cannot rewind, the slot's whole history when the prompt extends it, else its last resume
        point within the shared prefix (else 0)."""
        held = self.held[slot]
        if not self.enabled or not held or len(prompt) < 2:
            return 0
        k = min(shared_prefix(held, prompt), len(prompt) - 1)
        if self.rewinds or k == len(held):
            return k
        points = self.resume_points(slot) if self.resume_points is not None else ()
        return max((p for p in points if p <= k), default=0)

    def pick(self, free: Sequence[int], prompt: Sequence[int]) -> tuple[int, int]:
        """``(slot, reused)``: what :meth:`choose` would choose for ``prompt``, changing nothing.

        Raises:
            ValueError: no free slot.
        """
        if not free:
            raise ValueError("no free slot")
        best, reused = None, 0
        for s in free:
            k = self.reusable(s, prompt)
            if k > reused:
                best, reused = s, k
        # nothing shared: a slot that holds nothing, else the least recently used
        return (self._first_to_give_up(free) if best is None else best), reused

    def choose(self, free: Sequence[int], prompt: Sequence[int], *, preempted: bool = False) -> tuple[int, int]:
        """``(slot, reused)``: the free slot for ``prompt`` and the tokens it skips; counted in
        :attr:`stats` (``preempted``: a preempted sequence resuming, counted apart). The slot is no
        longer free: its held tokens are dropped here.

        Raises:
            ValueError: no free slot.
        """
        best, reused = self.pick(free, prompt)
        self.held[best] = ()
        st = self.stats
        if preempted:
            st.preempted_queries += 1
            st.preempted_query_tokens += len(prompt)
            st.preempted_hit_tokens += reused
        else:
            st.queries += 1
            st.query_tokens += len(prompt)
            st.hits += reused > 0
            st.hit_tokens += reused
        return best, reused

    def evictable(self, free: Sequence[int]) -> int:
        """The free slot to give up first: one that holds nothing, else the least recently used; what
        it held is forgotten here.

        Raises:
            ValueError: no free slot.
        """
        if not free:
            raise ValueError("no free slot")
        slot = self._first_to_give_up(free)
        self.held[slot] = ()
        return slot

    def _first_to_give_up(self, free: Sequence[int]) -> int:
        empty = [s for s in free if not self.held[s]]
        return min(empty) if empty else min(free, key=lambda s: self._used[s])

    def held_positions(self) -> int:
        """Positions the free slots hold for reuse (sum of H)."""
        return sum(map(len, self.held))
