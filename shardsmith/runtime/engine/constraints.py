"""Token constraints: a sequence whose next token must keep its output inside a grammar (a JSON
schema, a tool call's arguments) gets the tokens it may not take masked out before it chooses.

The scheduler asks each constrained sequence for a bitmask row of the tokens it allows
(:class:`TokenConstraint`, filled on the host by a grammar library: ``serve/structured.py`` wraps
llguidance), copies the rows of a step to the logits' device at once and sets every refused token's
logit to ``-inf`` there (:func:`apply_bitmask`); the chosen token is then fed back to the constraint
(:meth:`TokenConstraint.advance`). Because the next mask depends on the token just chosen, a step
with a constrained sequence reads its tokens before the next step is launched (no overlapped steps
while one runs).

Bitmask layout (llguidance's and xgrammar's): ``int32 [R, W]``, ``W = ceil(V / 32)``; bit ``j`` of
word ``w`` of row ``r`` (``(mask[r, w] >> j) & 1``) allows token ``32 * w + j``.

Legend: R = rows of a step, V = vocabulary (logits' width), W = 32-bit words per row.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["TokenConstraint", "allow_all", "apply_bitmask", "bitmask_width"]


class TokenConstraint(Protocol):
    """What the scheduler needs of a constrained sequence (rank 0, the engine thread)."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of ``bitmask`` (int32 ``[R, W]``, CPU, contiguous)."""

    def advance(self, token: int) -> None:
        """The sequence took ``token`` (one the last mask allowed)."""


def bitmask_width(vocab: int) -> int:
    """``W``: 32-bit words per bitmask row for ``vocab`` tokens."""
    return (vocab + 31) // 32


def allow_all(rows: int, vocab: int) -> torch.Tensor:
    """An int32 ``[rows, W]`` CPU bitmask that allows every token (rows without a constraint)."""
    return torch.full((rows, bitmask_width(vocab)), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set ``logits[r, t]`` to ``-inf`` where bit ``t`` of ``bitmask`` row ``r`` is clear, in place;
    tokens past ``32 * W`` are refused too. Returns ``logits``.

    Args:
        logits: ``[R, V]`` float, any device. bitmask: int32 ``[R, W]`` (any device; moved to
            ``logits``' device).

    Raises:
        ValueError: the row counts differ, or ``bitmask`` is not int32.
    """
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"apply_bitmask: an int32 [{logits.shape[0]}, W] bitmask is needed, got "
                         f"{bitmask.dtype} {tuple(bitmask.shape)}")
    R, V = logits.shape
    words = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().reshape(R, -1)  # [R, 32 W]
    keep = allowed[:, :V]
    if keep.shape[1] < V:  # a bitmask narrower than the logits refuses the rest
        keep = torch.cat([keep, keep.new_zeros(R, V - keep.shape[1])], dim=1)
    return logits.masked_fill_(~keep, float("-inf"))
