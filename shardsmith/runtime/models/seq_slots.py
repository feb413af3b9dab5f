"""Per-sequence slots of a position-indexed cache, and the rows of a batched decode step.

A model whose per-sequence state is a cache indexed by position (a KV cache, DeepSeek-V3's latent
cache) keeps ``max_num_seqs`` independent sequences in slots ``0..max_num_seqs-1`` of its cache
arrays (leading dim N). :class:`SeqSlots` holds the host-side bookkeeping every such family
shares: how many positions each slot holds, the checks of a prefill or step against it, and the
validated rows of a batched decode step (:class:`Rows`), whose device tensors the model's layers
read. The cache arrays themselves stay in the model (their layout is the family's).

Batched decode step contract (``engine/cuda_graphs.py``'s piece table): row ``b`` of a
step of ``B`` rows is slot ``slots[b]``'s token at position ``starts[b]`` (a slot's rows, when it
has several, are consecutive positions in order: a verify run, :func:`verify_runs`); rows ``>= real`` are
padding the engine adds to reach a captured batch bucket, copies of row 0's start and slot, that
change no state and whose outputs are ignored. Source of the design: vLLM's and SGLang's
preallocated per-request KV slots (``req_to_token_pool``), with one slot per sequence instead of pages.

Legend: B = rows of a step (a batch bucket), N = slots (``max_num_seqs``), S = attended positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardsmith.errors import UsageError
from shardsmith.runtime.models.kv_blocks import KVBlocks


@dataclass(frozen=True, slots=True)
class Rows:
    """The validated rows of one batched decode step and their device tensors.

    Attributes:
        starts, slots: per row (``B`` each, padding rows included), position and slot.
        real: rows ``< real`` are sequences; the others padding (copies of row 0).
        pos: ``[B]`` int64 positions on the model's device; slot_index: ``[B]`` int64 slots.
        length: attended positions ``max(starts) + 1`` (the only shape that varies between steps).
        cos, sin: ``[B, r]`` the family's RoPE tables at each row's own position.
        kv_write, kv_read: where the KV cache sits in blocks (:mod:`~shardsmith.runtime.models.kv_blocks`),
            the pool positions ``[real]`` the real rows write and ``[B, length]`` each row's slot reads
            (past its own blocks, position 0: masked); else None.
    """

    starts: tuple[int, ...]
    slots: tuple[int, ...]
    real: int
    pos: torch.Tensor
    slot_index: torch.Tensor
    length: int
    cos: torch.Tensor
    sin: torch.Tensor
    kv_write: torch.Tensor | None = None
    kv_read: torch.Tensor | None = None

    @property
    def start(self) -> int:
        """Row 0's position (the one-row form's ``step.start``)."""
        return self.starts[0]

    def positions(self, lo: int, device: torch.device) -> torch.Tensor:
        """Key positions ``[S]`` = ``lo .. length-1`` (int64), for masks."""
        return torch.arange(lo, self.length, device=device)

    def keep_padding(self, out: torch.Tensor) -> torch.Tensor:
        """``out [B, ...]`` with padding rows set to row 0's (in place; returned)."""
        if self.real < out.shape[0]:
            out[self.real:] = out[:1]
        return out


class SeqSlots:
    """How many positions each of ``max_num_seqs`` slots holds (host bookkeeping, no tensors).

    Args:
        family: model family name for messages; max_num_seqs: N slots; max_seq_len: positions per slot.
        kv: the slots' block tables where the cache sits in blocks: every checked step first leaves its
            slots the blocks of their new ends (:meth:`KVBlocks.fit`), a release gives them back.

    Raises:
        UsageError: ``max_num_seqs`` or ``max_seq_len`` below 1.
    """

    def __init__(self, family: str, max_num_seqs: int, max_seq_len: int, kv: KVBlocks | None = None) -> None:
        if max_num_seqs < 1 or max_seq_len < 1:
            raise UsageError(f"{family}: max_num_seqs ({max_num_seqs}) and max_seq_len ({max_seq_len}) must be >= 1")
        self.family, self.max_num_seqs, self.max_seq_len, self.kv = family, max_num_seqs, max_seq_len, kv
        self.lengths = [0] * max_num_seqs

    def check_slot(self, slot: int) -> None:
        """Raises UsageError unless ``0 <= slot < max_num_seqs``."""
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.max_num_seqs:
            raise UsageError(f"{self.family}: slot {slot!r} is outside 0..{self.max_num_seqs - 1} "
                             f"(max_num_seqs={self.max_num_seqs})")

    def _check(self, slot: int, start: int, T: int) -> None:
        self.check_slot(slot)
        if start < 0 or start > self.lengths[slot]:
            raise UsageError(f"{self.family}: slot {slot} holds {self.lengths[slot]} positions; a step must start "
                             f"at or before there (0 begins a new sequence), got start={start}")
        if start + T > self.max_seq_len:
            raise UsageError(f"{self.family}: slot {slot}: {start + T} positions exceed max_seq_len={self.max_seq_len}")

    def begin(self, slot: int, start: int, T: int) -> None:
        """Check a ``T``-token prefill (chunk) or step at ``start`` in ``slot`` and record its end.

        Raises:
            UsageError: a bad slot, a start past the slot's end (or negative), or past ``max_seq_len``.
            KVCacheFull: too few free blocks (nothing changes).
        """
        self._check(slot, start, T)
        if self.kv is not None:
            self.kv.fit({slot: start + T})
        self.lengths[slot] = start + T

    def release(self, slot: int) -> None:
        """Forget ``slot``'s sequence (its next step must start at 0).

        Raises:
            UsageError: a bad slot.
        """
        self.check_slot(slot)
        self.lengths[slot] = 0
        if self.kv is not None:
            self.kv.release(slot)

    def rows(self, ids: torch.Tensor, starts: int | list[int], slots: list[int] | None,
             real: int | None) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """Check a decode step's rows and record each real row's new end.

        Accepts the one-row form (``starts`` an int, ``slots`` None: slot 0).

        Returns:
            ``(starts, slots, real)`` as tuples of B ints and an int.

        Raises:
            UsageError: ``ids`` not ``[B]``, ``starts``/``slots`` not B long, ``real`` outside
                ``1..B``, real rows of one slot that are not one verify run (:func:`verify_runs`), a
                padding row that is not a copy of row 0's start and slot, or a real row's bad slot,
                start or length (as :meth:`begin`).
        """
        if isinstance(starts, int):
            starts = [starts]
            slots = [0] if slots is None else slots
        starts, slots = tuple(int(s) for s in starts), tuple(int(s) for s in (slots if slots is not None else [0] * len(starts)))
        B = ids.shape[0] if ids.dim() == 1 else -1
        if B != len(starts) or B != len(slots) or B < 1:
            raise UsageError(f"{self.family}: a decode step needs ids [B] with B starts and B slots; got ids "
                             f"{list(ids.shape)}, {len(starts)} starts, {len(slots)} slots")
        real = B if real is None else int(real)
        if not 1 <= real <= B:
            raise UsageError(f"{self.family}: real={real} rows must be within 1..{B} (the step's rows)")
        runs = verify_runs(starts[:real], slots[:real], family=self.family)
        bad = [b for b in range(real, B) if (starts[b], slots[b]) != (starts[0], slots[0])]
        if bad:
            raise UsageError(f"{self.family}: padding rows {bad} must copy row 0's start and slot "
                             f"({starts[0]}, {slots[0]})")
        for slot, (first, n) in runs.items():
            self._check(slot, first, n)
        if self.kv is not None:
            self.kv.fit({slot: first + n for slot, (first, n) in runs.items()})
        for slot, (first, n) in runs.items():
            self.lengths[slot] = first + n
        return starts, slots, real

    def step_rows(self, ids: torch.Tensor, starts: int | list[int], slots: list[int] | None, real: int | None,
                  cos: torch.Tensor, sin: torch.Tensor) -> Rows:
        """:meth:`rows` with the device tensors, RoPE gathered from ``cos``/``sin`` ``[S_max, r]``."""
        starts, slots, real = self.rows(ids, starts, slots, real)
        pos = torch.tensor(starts, dtype=torch.int64, device=cos.device)
        length = max(starts) + 1
        kv = self.kv
        return Rows(starts, slots, real, pos, torch.tensor(slots, dtype=torch.int64, device=cos.device),
                    length, cos.index_select(0, pos), sin.index_select(0, pos),
                    None if kv is None else kv.positions(slots[:real], starts[:real], cos.device),
                    None if kv is None else kv.gather(slots, length, cos.device))


def verify_runs(starts: Sequence[int], slots: Sequence[int], *, family: str) -> dict[int, tuple[int, int]]:
    """A step's real rows grouped by slot: ``{slot: (first position, rows)}``. A slot may have several
    rows, a speculative verify run (its pending token and the draft), when they sit at consecutive
    positions in row order: every row writes its position before any attends, and each attends up to
    its own, so row ``j`` of a run sees the rows before it as a prefill chunk would.

    Raises:
        UsageError: a slot's rows at positions that are not consecutive and ascending.
    """
    runs: dict[int, list[int]] = {}
    for start, slot in zip(starts, slots):
        runs.setdefault(slot, []).append(start)
    bad = sorted(slot for slot, ps in runs.items() if any(b != a + 1 for a, b in zip(ps, ps[1:])))
    if bad:
        raise UsageError(f"{family}: slots {bad} appear in more than one real row at positions that are not one "
                         f"verify run (a slot's rows must be consecutive positions, in order)")
    return {slot: (ps[0], len(ps)) for slot, ps in runs.items()}


def cache_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes held by ``tensors`` (None skipped)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
