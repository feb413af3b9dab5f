"""The rows of a DeepSeek-V4 decode step on the device, built once per step and shared by the layers.

A batched decode step (``B`` rows, one token of a different slot each, or a slot's consecutive
positions in several rows: a speculative verify run; padding rows use the model's scratch slot) needs a few small device tensors derived from the rows' positions and slots:
the window column and mask, per compression ratio the pending-window column, the visibility mask,
the rows that complete a window and their entry's index and RoPE, and the RoPE tables. They depend
on the step, not on the layer, so :class:`DecodeRows` builds each once (on first use, or all at
once by :meth:`DecodeRows.as_tuple`) and every layer reuses it (the eager attention core's host
cost is per torch op).

Every derived tensor is computed by torch ops from the two inputs ``positions [B]`` and
``index [B]`` alone: no host values, no host-device copies, no shape that depends on data. Shapes
are fixed by ``B`` and the step's **length bucket** ``key`` (:func:`length_bucket`): ratio ``r``'s
entries are attended as ``C = min(key, max_seq_len) // r`` columns, the entries a row at a
position below ``key`` can see at most. So a step of the same ``(B, key)`` reruns the same kernels
on the same shapes, which is what a CUDA graph replays.

Masks are additive float32 biases (``0`` visible, ``-inf`` hidden), laid out as the attention's
key buffer is (:class:`~shardsmith.runtime.models.deepseek_v4.attention.Attention`):
``[sink | window ring (W) | compressed entries (C)]``.

Legend: B = rows of the step (padding included), W = window, K = most rows of one slot (a verify
run), R = window ring rows (``W + K - 1``), r = ratio, C = entry columns of the bucket, E = entries
allocated per slot (``max_seq_len // r``), h = rope dims / 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardsmith.runtime.models.deepseek_v4.ops import rope_cos_sin, rope_pairs

NEG_INF = float("-inf")
LENGTH_BUCKET_MIN = 512  # the smallest length bucket: short sequences share one shape (tokens)


def host_to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``: one copy, asynchronous from pinned memory on CUDA
    (the pinned block is recycled only after the copy's stream passes it: PyTorch's caching host
    allocator records the copy)."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=torch.int64, device=device)


def length_bucket(furthest: int, max_seq_len: int) -> int:
    """The length bucket of a step whose furthest row is at position ``furthest``: the smallest power
    of two ``>= furthest + 1``, at least :data:`LENGTH_BUCKET_MIN`, at most ``max_seq_len`` (tokens)."""
    return min(max(LENGTH_BUCKET_MIN, 1 << furthest.bit_length()), max_seq_len)


def length_buckets(max_seq_len: int) -> list[int]:
    """Every length bucket of ``max_seq_len`` positions, ascending: :data:`LENGTH_BUCKET_MIN`, twice it, ...,
    ``max_seq_len`` (tokens).

    >>> length_buckets(3000), length_buckets(300)
    ([512, 1024, 2048, 3000], [300])
    """
    out, b = [], LENGTH_BUCKET_MIN
    while b < max_seq_len:
        out.append(b)
        b *= 2
    return out + [max_seq_len]


@dataclass(frozen=True, eq=False)
class RowsSpec:
    """What a model's layers ask of a step's rows (fixed by the model and its cache).

    Attributes:
        window: W, the sliding window (tokens); ratios: the compression ratios that have entries
        (``E = max_seq_len // r > 0``), ascending; max_seq_len: positions per slot (tokens);
        freqs: RoPE inverse frequencies ``[h]`` by table name (``main``: sliding layers,
        ``compress``: compressed layers and every compressor's entries), on the model's device;
        runs: K, the most rows one slot may have in a step (a speculative verify run; 1: one row
        per slot); ring: R, the window ring's rows, ``W + K - 1`` (so that no row of a run writes
        over a key an earlier row of it attends: position ``p`` sits at ``p % R``).
    """

    window: int
    ratios: tuple[int, ...]
    max_seq_len: int
    freqs: dict[str, torch.Tensor]
    runs: int = 1

    @property
    def ring(self) -> int:
        """R = ``W + runs - 1``, the window ring's rows."""
        return self.window + self.runs - 1


class DecodeRows:
    """One step's rows on the device and the tensors derived from them (each built once, by torch ops).

    Args:
        positions: ``[B]`` int64, each row's position (padding rows: any position below
            ``max_seq_len``; the model gives them row 0's); index: ``[B]`` int64, each row's slot
            (padding rows: ``scratch``); key: the length bucket, above every row's position;
        scratch: the slot that belongs to no sequence (padding rows read and write it);
        spec: the model's :class:`RowsSpec`.

    Attributes:
        positions, index, key, scratch, spec: as given; span: ``min(key, max_seq_len)``.
    """

    def __init__(self, positions: torch.Tensor, index: torch.Tensor, key: int, scratch: int,
                 spec: RowsSpec) -> None:
        self.positions, self.index, self.key, self.scratch, self.spec = positions, index, key, scratch, spec
        self.span = min(key, spec.max_seq_len)
        self._cache: dict[tuple, object] = {}

    def _get(self, key: tuple, build):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    @property
    def padding(self) -> torch.Tensor:
        """``[B]`` bool: the padding rows (slot ``scratch``)."""
        return self._get(("padding",), lambda: self.index == self.scratch)

    def rope(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[B, h]`` float32 of table ``name`` (:class:`RowsSpec`) at every row's position."""
        return self._get(("rope", name), lambda: rope_cos_sin(self.positions, self.spec.freqs[name]))

    def window(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(col [B], bias [B, R])``: each row's ring row (``position % R``) and the window bias.

        One row per slot (``R = W``): ring row ``j`` holds position ``p = j (mod W)``, hidden while
        ``j > position`` (not yet written). With runs (``R > W``) every row of the step writes before
        any attends, so ring row ``j`` holds the latest position ``P = j (mod R)`` at or below the
        furthest row of the row's slot (:meth:`runs`' ``last``), and a row at ``p`` sees it iff
        ``p - W < P <= p`` and ``P >= 0``; a later row's write replaced only a position ``W + K - 1``
        or more behind it, outside every row's window."""
        def build():
            W, R = self.spec.window, self.spec.ring
            j = torch.arange(R, device=self.index.device)
            p = self.positions[:, None]
            if R == W:
                return self.positions % W, torch.where(j[None, :] <= p, 0.0, NEG_INF)
            last = self.runs()[0][:, None]
            held = last - torch.remainder(last - j[None, :], R)  # [B, R] the position ring row j holds
            seen = (held <= p) & (held > p - W) & (held >= 0)
            return self.positions % R, torch.where(seen, 0.0, NEG_INF)
        return self._get(("window",), build)

    def runs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(last [B], phase [B])`` int64: the furthest position among the rows of each row's slot,
        and the row's place in its slot's run (``position - first``; 0 for a slot's only row). Rows
        of one slot are consecutive positions (:func:`~shardsmith.runtime.models.seq_slots.verify_runs`);
        padding rows share the scratch slot at row 0's position (phase 0). One row per slot
        (``spec.runs == 1``): ``(positions, 0)`` with no reduction."""
        def build():
            if self.spec.runs == 1:
                return self.positions, torch.zeros_like(self.positions)
            n = self.scratch + 1
            hi = self.positions.new_full((n,), -1).scatter_reduce(0, self.index, self.positions, "amax")
            lo = self.positions.new_full((n,), self.spec.max_seq_len).scatter_reduce(0, self.index, self.positions, "amin")
            return hi[self.index], self.positions - lo[self.index]
        return self._get(("runs",), build)

    def run_lengths(self) -> torch.Tensor:
        """``[B]`` int64: at a run's first row (phase 0) the run's rows (1 for a slot's only row, and
        for each padding row), 0 at its other rows: what a compressor launch that takes each run's rows
        in one program (:func:`~shardsmith.runtime.layers.kernels.deepseek_v4.compressor_step.compressor_step`'s
        ``run``) reads. Rows of a run follow one another in the step."""
        def build():
            last, phase = self.runs()
            return torch.where(phase == 0, last - self.positions + 1, 0)
        return self._get(("run_lengths",), build)

    def phase(self, ratio: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index [B], done [B])`` of the step's ``j``-th rows of each run for ratio ``ratio``'s
        compressors: the other rows' slot replaced by the scratch slot, and only ``j``-th rows that
        complete a window done; a compressor takes the step's rows in ``spec.runs`` such phases, so
        a run's rows enter its slot's pending window in order."""
        def build():
            here = self.runs()[1] == j
            return torch.where(here, self.index, self.scratch), self.completion(ratio)[0] & here
        return self._get(("phase", ratio, j), build)

    def count(self, ratio: int) -> int:
        """``C``: the entry columns of ratio ``ratio`` in this bucket, ``min(key, max_seq_len) // ratio``
        (every entry a row below the bucket can see; never more than the ``E`` allocated)."""
        return self.span // ratio

    def column(self, ratio: int) -> torch.Tensor:
        """``[B]``: each row's column in its slot's pending window (``position % ratio``)."""
        return self._get(("column", ratio), lambda: self.positions % ratio)

    def visible(self, ratio: int) -> torch.Tensor:
        """``[B, C]`` bias: entry ``w`` is visible to row ``i`` iff its window is complete
        (``w < (position + 1) // ratio``; compressor.py's :func:`visible`)."""
        def build():
            w = torch.arange(self.count(ratio), device=self.index.device)
            return torch.where(w[None, :] < ((self.positions + 1) // ratio)[:, None], 0.0, NEG_INF)
        return self._get(("visible", ratio), build)

    def keys_bias(self, ratio: int | None) -> torch.Tensor:
        """``[B, W + C]``: the window bias, then (``ratio`` given) every complete entry visible; the
        mask of a sliding (``ratio`` None) or HCA layer's keys after the sink."""
        if ratio is None:
            return self.window()[1]
        return self._get(("keys", ratio), lambda: torch.cat((self.window()[1], self.visible(ratio)), dim=1))

    def completion(self, ratio: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Ratio ``ratio``'s window completions at this step: ``(done [B] bool, entry [B] int64, cs, sn
        [B, 2h])``. ``done``: the row is real and completes its window (``position % r == r - 1``);
        ``entry``: the entry that window fills, ``position // r``, clamped to ``E - 1`` so that a masked
        write of a row that is not done stays in bounds (a done row is always below ``E``); ``cs``/``sn``:
        the entry's RoPE at ``entry * r`` (table ``compress``, as :func:`rope_pairs` tables)."""
        def build():
            E = self.spec.max_seq_len // ratio
            done = (self.positions % ratio == ratio - 1) & ~self.padding
            entry = (self.positions // ratio).clamp(max=E - 1)
            return (done, entry, *rope_pairs(*rope_cos_sin(entry * ratio, self.spec.freqs["compress"])))
        return self._get(("completion", ratio), build)

    def _names(self) -> list[tuple]:
        """The cache keys of every tensor the layers may ask for, in :meth:`as_tuple`'s order."""
        names = [("padding",), ("rope", "main"), ("rope", "compress"), ("window",)]
        if self.spec.runs > 1:
            names += [("runs",), ("run_lengths",)]
        for r in self.spec.ratios:
            names += [("column", r), ("visible", r), ("keys", r), ("completion", r)]
        return names

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        """Every tensor the layers may need, built now, flat in a fixed order: ``positions, index,
        padding, rope main (cos, sin), rope compress (cos, sin), window (col, bias)``, with runs
        (``spec.runs > 1``) ``last, phase, run lengths``, then per ratio of
        the spec (ascending) ``column, visible, keys, done, entry, cs, sn``. :meth:`from_tuple` inverts it."""
        builders = {"padding": lambda: self.padding, "rope": lambda n: self.rope(n), "window": self.window,
                    "runs": self.runs, "run_lengths": self.run_lengths,
                    "column": self.column, "visible": self.visible, "keys": self.keys_bias,
                    "completion": self.completion}
        out = [self.positions, self.index]
        for name in self._names():
            value = builders[name[0]](*name[1:])
            out += list(value) if isinstance(value, tuple) else [value]
        return tuple(out)

    @classmethod
    def from_tuple(cls, tensors: tuple[torch.Tensor, ...] | list[torch.Tensor], key: int, scratch: int,
                   spec: RowsSpec) -> "DecodeRows":
        """The rows whose :meth:`as_tuple` was ``tensors`` (same ``key``, ``scratch``, ``spec``), rebuilt
        without a torch op (e.g. from a captured piece's static outputs).

        Raises:
            ValueError: ``tensors`` does not have :meth:`as_tuple`'s length for ``spec``.
        """
        rows = cls(tensors[0], tensors[1], key, scratch, spec)
        sizes = {"padding": 1, "rope": 2, "window": 2, "runs": 2, "run_lengths": 1, "column": 1, "visible": 1, "keys": 1,
                 "completion": 4}
        names = rows._names()
        want = 2 + sum(sizes[n[0]] for n in names)
        if len(tensors) != want:
            raise ValueError(f"DecodeRows.from_tuple: {len(tensors)} tensors, the spec's as_tuple has {want}")
        i = 2
        for name in names:
            n = sizes[name[0]]
            rows._cache[name] = tensors[i] if n == 1 else tuple(tensors[i:i + n])
            i += n
        return rows
