"""A position-indexed KV cache kept in blocks: one pool per layer, a block table per slot.

The pool holds ``P`` blocks of ``B`` positions (``kv_cache_tokens = P * B``, shared by every slot);
slot ``s``'s position ``p`` lives at pool position ``table[s][p // B] * B + p % B``. A slot holds
blocks only for the positions its sequence has: a step that ends at ``end`` leaves it
``ceil(end / B)`` blocks (growing from the free list, or giving back what a rewind left past the
end), and a released slot holds none. So the pool is sized for the tokens the running sequences
hold together, not ``max_num_seqs * max_seq_len``. Source of the design: vLLM's paged KV blocks and
block tables (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023), here without block sharing between sequences.

:class:`KVBlocks` is host bookkeeping (no KV tensors) and is deterministic: every tensor-parallel
rank runs the same steps in the same order, so every rank's tables are the same and rank 0's
answer to :meth:`KVBlocks.blocks_free` holds for all. The device index of a slot's positions is a
slice of the pool when its blocks are consecutive (a view, no copy) and a gather index otherwise.

Legend: P = blocks in the pool, B = positions per block, N = slots, S = a slot's positions.
"""

from __future__ import annotations

import torch

from shardsmith.errors import UsageError

__all__ = ["KV_BLOCK_TOKENS", "KVBlocks", "KVCacheFull", "kv_blocks_for"]

KV_BLOCK_TOKENS = 16
"""Positions per block (vLLM's default block size): at most ``B - 1`` positions of a sequence are unused."""


class KVCacheFull(UsageError):
    """A step needs more blocks than the pool has free (the scheduler admits sequences so that the
    ones it runs never do; a direct caller of the model can)."""


def blocks_for(positions: int, block_size: int) -> int:
    """Blocks that hold ``positions`` positions: ``ceil(positions / block_size)``."""
    return -(-max(positions, 0) // block_size)


def kv_blocks_for(max_seq_len: int, max_num_seqs: int, kv_cache_tokens: int | None = None,
                  block_size: int = KV_BLOCK_TOKENS) -> int:
    """Blocks of a pool of ``kv_cache_tokens`` positions (None: ``max_num_seqs * max_seq_len``, every slot at
    its longest at once), rounded up: a model's ``setup_cache`` allocates this many."""
    tokens = max_num_seqs * max_seq_len if kv_cache_tokens is None else kv_cache_tokens
    return max(1, blocks_for(tokens, block_size))


class KVBlocks:
    """The block tables of ``n_slots`` slots over a pool of ``n_blocks`` blocks of ``block_size``
    positions.

    Args:
        n_blocks: P, blocks in the pool (>= ``ceil(max_seq_len / block_size)``: one sequence of the
            longest length always fits); block_size: B positions per block; n_slots: N;
            max_seq_len: positions a slot may hold.

    Raises:
        UsageError: a size below 1, or a pool smaller than one ``max_seq_len`` sequence.
    """

    def __init__(self, n_blocks: int, block_size: int, n_slots: int, max_seq_len: int) -> None:
        if min(n_blocks, block_size, n_slots, max_seq_len) < 1:
            raise UsageError(f"KV blocks: n_blocks ({n_blocks}), block_size ({block_size}), slots ({n_slots}) and "
                             f"max_seq_len ({max_seq_len}) must be >= 1")
        if n_blocks < blocks_for(max_seq_len, block_size):
            raise UsageError(f"the KV cache holds {n_blocks * block_size} tokens ({n_blocks} blocks of {block_size}); "
                             f"one sequence of max_seq_len={max_seq_len} needs "
                             f"{blocks_for(max_seq_len, block_size) * block_size}: raise --kv-cache-tokens or lower "
                             f"--max-model-len")
        self.n_blocks, self.block_size, self.n_slots, self.max_seq_len = n_blocks, block_size, n_slots, max_seq_len
        self.tables: list[list[int]] = [[] for _ in range(n_slots)]
        self._free = [True] * n_blocks
        self._n_free = n_blocks
        self._lowest = 0  # no free block below this index
        self._index: list[tuple[torch.device, torch.Tensor | slice] | None] = [None] * n_slots

    @classmethod
    def for_slots(cls, max_seq_len: int, max_num_seqs: int, kv_cache_tokens: int | None = None,
                  block_size: int = KV_BLOCK_TOKENS) -> KVBlocks:
        """The tables of ``max_num_seqs`` slots of up to ``max_seq_len`` positions over a pool of
        :func:`kv_blocks_for` blocks (what a model's ``setup_cache`` allocates its pools for).

        Raises:
            UsageError: a size below 1, or a pool smaller than one ``max_seq_len`` sequence.
        """
        return cls(kv_blocks_for(max_seq_len, max_num_seqs, kv_cache_tokens, block_size), block_size, max_num_seqs,
                   max_seq_len)

    @property
    def tokens(self) -> int:
        """Positions the pool holds (``P * B``)."""
        return self.n_blocks * self.block_size

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold ``positions`` positions."""
        return blocks_for(positions, self.block_size)

    def blocks_free(self) -> int:
        """Blocks no slot holds."""
        return self._n_free

    def held(self, slot: int) -> int:
        """Blocks ``slot`` holds."""
        return len(self.tables[slot])

    def fit(self, ends: dict[int, int]) -> None:
        """Leave each ``slot`` of ``ends`` exactly the blocks of positions ``[0, end)``: growing from
        the free list, shrinking by giving blocks back. All or nothing: the pool is checked first.

        A slot grows into the block after its last one when that is free (its positions stay one
        slice of the pool); a slot's first block, or one after a taken block, goes halfway along the
        largest free run (at its start when that is the pool's start), leaving room to grow on both sides.

        Raises:
            KVCacheFull: the slots together need more blocks than are free; nothing changes.
        """
        grow = {s: self.blocks_for(e) - self.held(s) for s, e in ends.items()}
        need = sum(n for n in grow.values() if n > 0)
        back = sum(-n for n in grow.values() if n < 0)
        if need > self._n_free + back:
            parts = ", ".join(f"slot {s} to {e} positions" for s, e in sorted(ends.items()))
            raise KVCacheFull(f"the KV cache is full: {parts} needs {need} more block(s) of {self.block_size} "
                              f"positions and {self._n_free + back} of {self.n_blocks} are free (--kv-cache-tokens "
                              f"{self.tokens})")
        for s, n in grow.items():  # give back first, so the growing slots may take those blocks
            if n < 0:
                for b in self.tables[s][n:]:
                    self._give(b)
                del self.tables[s][n:]
                self._index[s] = None
        for s, n in grow.items():
            for _ in range(n):
                self.tables[s].append(self._take(self.tables[s][-1] + 1 if self.tables[s] else -1))
            if n > 0:
                self._index[s] = None

    def release(self, slot: int) -> None:
        """``slot`` holds no block."""
        self.fit({slot: 0})

    def index(self, slot: int, lo: int, hi: int, device: torch.device) -> torch.Tensor | slice:
        """Pool positions of ``slot``'s positions ``[lo, hi)`` (within its blocks): a ``slice`` when its
        blocks are consecutive, else an int64 gather index ``[hi - lo]`` on ``device`` (cached until the
        slot's table changes). Index dim 1 of a ``[K, P * B, d]`` pool with it."""
        cached = self._index[slot]
        if cached is None or cached[0] != device:
            table, B = self.tables[slot], self.block_size
            if table and table == list(range(table[0], table[0] + len(table))):
                full: torch.Tensor | slice = slice(table[0] * B, (table[-1] + 1) * B)
            else:
                t = torch.tensor(table, dtype=torch.int64, device=device)
                full = (t[:, None] * B + torch.arange(B, device=device)).reshape(-1)
            cached = self._index[slot] = (device, full)
        full = cached[1]
        if isinstance(full, slice):
            return slice(full.start + lo, full.start + hi)
        return full[lo:hi]

    def positions(self, slots: list[int] | tuple[int, ...], starts: list[int] | tuple[int, ...],
                  device: torch.device) -> torch.Tensor:
        """Pool positions ``[R]`` (int64, on ``device``) of each ``(slot, position)`` pair, within its blocks."""
        B = self.block_size
        return torch.tensor([self.tables[s][p // B] * B + p % B for s, p in zip(slots, starts)], dtype=torch.int64,
                            device=device)

    def gather(self, slots: list[int] | tuple[int, ...], length: int, device: torch.device) -> torch.Tensor:
        """Pool positions ``[len(slots), length]`` (int64, on ``device``): row ``b`` is slot ``slots[b]``'s
        positions ``0 .. length-1``; past the slot's blocks, pool position 0 (its caller masks them). Built
        from each slot's cached :meth:`index` (no host list of every position)."""
        rows = []
        for s in slots:
            n = min(length, self.held(s) * self.block_size)
            idx = self.index(s, 0, n, device)
            if isinstance(idx, slice):
                idx = torch.arange(idx.start, idx.stop, dtype=torch.int64, device=device)
            rows.append(torch.nn.functional.pad(idx, (0, length - n)))
        return torch.stack(rows)

    def _take(self, prefer: int) -> int:
        b = prefer if 0 <= prefer < self.n_blocks and self._free[prefer] else self._place()
        self._free[b] = False
        self._n_free -= 1
        if b == self._lowest:
            while self._lowest < self.n_blocks and not self._free[self._lowest]:
                self._lowest += 1
        return b

    def _place(self) -> int:
        """Where a run of blocks starts (a slot's first block, or one whose next block is taken): in the
        largest free run, at its start when that is the pool's start, else halfway along, so the slot
        before the run and this one can both grow into consecutive blocks."""
        best, best_len, b = self._lowest, 0, self._lowest
        while b < self.n_blocks:
            if not self._free[b]:
                b += 1
                continue
            start = b
            while b < self.n_blocks and self._free[b]:
                b += 1
            if b - start > best_len:
                best, best_len = start, b - start
        return best if best == 0 else best + best_len // 2

    def _give(self, b: int) -> None:
        self._free[b] = True
        self._n_free += 1
        self._lowest = min(self._lowest, b)
