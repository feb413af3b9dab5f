"""The rows of a DeepSeek-V4 decode step on the device, built once per step and shared by the layers.

A batched decode step (``R`` real rows, one token of a different slot each, plus padding rows up to
the bucket's ``B``) needs a few small device tensors derived from the rows' positions: each layer's
window column and mask, each compression ratio's entry count, visibility mask, pending-window column
and the rows that complete a window, and the RoPE tables. They depend on the step, not on the
layer, so :class:`DecodeRows` builds each once, on first use, from one host-to-device copy of the
positions and slots, and every later layer of the same window or ratio reuses it (the eager
attention core's host cost is per torch op: issue 12).

Masks are additive float32 biases (``0`` visible, ``-inf`` hidden), laid out as the attention's
key buffer is (:class:`~shardsmith.runtime.models.deepseek_v4.attention.Attention`):
``[sink | window ring (W) | compressed entries (C)]``.

Legend: B = rows of the step (padding included), R = real rows, W = window, r = ratio, C = entries
visible to the step's furthest row, n = rows completing a window at this step, h = rope dims / 2.
"""

from __future__ import annotations

import torch

from shardsmith.runtime.models.deepseek_v4.ops import rope_cos_sin, rope_pairs

NEG_INF = float("-inf")


def host_to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``: one copy, asynchronous from pinned memory on CUDA
    (the pinned block is recycled only after the copy's stream passes it: PyTorch's caching host
    allocator records the copy)."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=torch.int64, device=device)


class DecodeRows:
    """One step's rows: positions ``[B]``, the real rows' slots ``[R]``, and per-step derived tensors.

    Args:
        starts: the ``B`` rows' positions (host ints; rows ``>= real`` are padding, copies of row 0);
        slots: the real rows' slots (``R`` distinct host ints); device: where the model runs.

    Attributes:
        starts: ``B`` host ints; slots: ``R`` host ints; real: ``R``;
        positions_all: ``[B]`` int64 on ``device``; positions: ``[R]`` (a view); index: ``[R]`` int64 slots.
    """

    def __init__(self, starts: list[int], slots: list[int], device: torch.device) -> None:
        self.starts, self.slots, self.real = list(starts), list(slots), len(slots)
        both = host_to_device(self.starts + self.slots, torch.device(device))  # one copy: [B + R]
        B = len(self.starts)
        self.positions_all, self.index = both[:B], both[B:]
        self.positions = self.positions_all[:self.real]
        self._cache: dict[tuple, object] = {}

    def rope(self, name: str, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[B, h]`` float32 of table ``name`` (``freqs``) at every row's position;
        the real rows' table is its first ``R`` rows."""
        key = ("rope", name)
        if key not in self._cache:
            self._cache[key] = rope_cos_sin(self.positions_all, freqs)
        return self._cache[key]

    def window(self, W: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(col [R], bias [R, W])``: each row's ring row (``position % W``) and the window bias
        (ring row ``j`` holds position ``p = j (mod W)``; hidden while ``j > position``: not yet written)."""
        key = ("window", W)
        if key not in self._cache:
            j = torch.arange(W, device=self.index.device)
            bias = torch.where(j[None, :] <= self.positions[:, None], 0.0, NEG_INF)
            self._cache[key] = (self.positions % W, bias)
        return self._cache[key]

    def count(self, ratio: int) -> int:
        """``C``: the most complete windows of ratio ``ratio`` any real row sees (host arithmetic)."""
        return max((t + 1) // ratio for t in self.starts[:self.real])

    def column(self, ratio: int) -> torch.Tensor:
        """``[R]``: each row's column in its slot's pending window (``position % ratio``)."""
        key = ("column", ratio)
        if key not in self._cache:
            self._cache[key] = self.positions % ratio
        return self._cache[key]

    def visible(self, ratio: int) -> torch.Tensor:
        """``[R, C]`` bias: entry ``w`` is visible to row ``i`` iff its window is complete
        (``w < (position + 1) // ratio``; compressor.py's :func:`visible`)."""
        key = ("visible", ratio)
        if key not in self._cache:
            w = torch.arange(self.count(ratio), device=self.index.device)
            self._cache[key] = torch.where(w[None, :] < ((self.positions + 1) // ratio)[:, None], 0.0, NEG_INF)
        return self._cache[key]

    def keys_bias(self, W: int, ratio: int | None) -> torch.Tensor:
        """``[R, W + C]``: the window bias, then (``ratio`` given) every complete entry visible; the
        mask of a sliding (``ratio`` None) or HCA layer's keys after the sink."""
        key = ("keys", W, ratio)
        if key not in self._cache:
            bias = self.window(W)[1]
            self._cache[key] = bias if ratio is None else torch.cat((bias, self.visible(ratio)), dim=1)
        return self._cache[key]

    def completed(self, ratio: int, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor] | None:
        """The real rows completing a window of ratio ``ratio`` at this step (``position % r == r - 1``):
        ``(slots [n], windows [n], cs, sn [n, 2h])`` (the entries' RoPE at ``window * r`` with ``freqs``,
        the compressed-layer table every compressor uses, as :func:`rope_pairs` tables), or None when
        no row does. Built from the host positions: one copy."""
        key = ("completed", ratio)
        if key not in self._cache:
            done = [i for i, t in enumerate(self.starts[:self.real]) if t % ratio == ratio - 1]
            value = None
            if done:
                both = host_to_device([self.slots[i] for i in done] + [self.starts[i] // ratio for i in done],
                                      self.index.device)
                slots, windows = both[:len(done)], both[len(done):]
                value = (slots, windows, *rope_pairs(*rope_cos_sin(windows * ratio, freqs)))
            self._cache[key] = value
        return self._cache[key]
