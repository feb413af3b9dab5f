"""Per-row logit adjustments of a batched step: logit bias, min_tokens, repetition, frequency and
presence penalties, applied where the logits are, from per-sequence token counts kept there.

Each sequence's counts live in its slot's row of :class:`TokenCounts` on the engine's device: how
often each token was generated (``counts [S, V]`` int32) and which tokens its prompt holds
(``prompt [S, V]`` bool). A chosen token is added on the device from the step's own output, so
nothing waits for the host and an overlapped step sees the token of the step before it. Legend:
S = slots, R = rows of a step that adjust, V = vocabulary.

Definitions and order (vLLM's sampler; each checked against its transformers processor in
``tests/runtime/engine/test_penalties.py``):

=====================  =========================================================================
``logit_bias``         ``x[t] += bias[t]`` (OpenAI; ``SequenceBiasLogitsProcessor``)
``min_tokens``         the stop tokens get ``-inf`` while fewer than ``min_tokens`` were generated
                       (``MinNewTokensLengthLogitsProcessor``)
``repetition_penalty`` over the prompt's and the generated tokens: ``x / r`` where ``x > 0``, else
                       ``x * r`` (CTRL, ``RepetitionPenaltyLogitsProcessor``)
``frequency_penalty``  ``x[t] -= count[t] * f`` over generated tokens (OpenAI)
``presence_penalty``   ``x[t] -= p`` for every generated token (OpenAI)
=====================  =========================================================================

Log-probabilities stay those of the raw logits (:func:`~shardsmith.runtime.engine.sampling.choose_on_device`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardsmith.runtime.engine.sampling import SamplingParams
from shardsmith.runtime.layers.staging import to_device


def adjusts(p: SamplingParams) -> bool:
    """Whether ``p`` changes the logits before the choice."""
    return bool(p.logit_bias) or p.min_tokens > 0 or counts_tokens(p)


def counts_tokens(p: SamplingParams) -> bool:
    """Whether ``p`` needs its sequence's token counts (a penalty)."""
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


class TokenCounts:
    """Generated-token counts and prompt-token presence per slot, on one device.

    Args:
        slots: rows (the engine's ``max_num_seqs``); vocab: V; device: the logits' device.
    """

    def __init__(self, slots: int, vocab: int, device: torch.device) -> None:
        self.counts = torch.zeros(slots, vocab, dtype=torch.int32, device=device)  # [S, V]
        self.prompt = torch.zeros(slots, vocab, dtype=torch.bool, device=device)  # [S, V]
        self.device = torch.device(device)

    def reset(self, slot: int, prompt_ids: Sequence[int], generated: Sequence[int] = ()) -> None:
        """Slot ``slot`` holds a sequence with ``prompt_ids`` that has generated ``generated`` so far
        (a sequence resumed in another slot after a preemption keeps its counts)."""
        self.counts[slot].zero_()
        self.prompt[slot].zero_()
        if prompt_ids:
            ids = to_device([torch.tensor(list(prompt_ids), dtype=torch.int64)], self.device)[0]
            self.prompt[slot].index_fill_(0, ids, True)
        if generated:
            ids = to_device([torch.tensor(list(generated), dtype=torch.int64)], self.device)[0]
            self.counts[slot].index_put_((ids,), torch.ones_like(ids, dtype=torch.int32), accumulate=True)

    def add(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """Count token ``ids[r]`` ``[R]`` (on the device) once in slot ``slots[r]`` ``[R]``."""
        self.counts.index_put_((slots, ids), torch.ones_like(ids, dtype=torch.int32), accumulate=True)


def apply(x: torch.Tensor, params: Sequence[SamplingParams], slots: Sequence[int], produced: Sequence[int],
          counts: TokenCounts | None) -> torch.Tensor:
    """``x`` ``[B, V]`` (float32) with each row's adjustments (module table), a new tensor.

    Args:
        params: per row its sampling; slots: per row its sequence's slot in ``counts``;
        produced: per row the tokens its sequence generated before this one (``min_tokens``);
        counts: the slots' counts (needed when a row has a penalty).

    Raises:
        ValueError: a penalty without ``counts``.
    """
    x = x.float().clone()
    dev, V = x.device, x.shape[-1]
    bias = [(b, t, v) for b, p in enumerate(params) for t, v in p.logit_bias if 0 <= t < V]
    masked = [(b, t) for b, p in enumerate(params) if produced[b] < p.min_tokens
              for t in p.stop_token_ids if 0 <= t < V]
    pen = [b for b, p in enumerate(params) if counts_tokens(p)]
    if pen and counts is None:
        raise ValueError("penalties need the slots' token counts")
    ints: list[torch.Tensor] = []  # staged in one copy per dtype (to_device)
    floats: list[torch.Tensor] = []
    if bias:
        ints += [torch.tensor([b for b, _, _ in bias]), torch.tensor([t for _, t, _ in bias])]
        floats.append(torch.tensor([v for _, _, v in bias], dtype=torch.float32))
    if masked:
        ints += [torch.tensor([b for b, _ in masked]), torch.tensor([t for _, t in masked])]
    if pen:
        ints += [torch.tensor(pen), torch.tensor([slots[b] for b in pen])]
        floats.append(torch.tensor([[params[b].repetition_penalty, params[b].frequency_penalty,
                                     params[b].presence_penalty] for b in pen], dtype=torch.float32).flatten())
    ints_dev = iter(to_device(ints, dev) if ints else ())
    floats_dev = iter(to_device(floats, dev) if floats else ())
    if bias:
        rows, ids, vals = next(ints_dev), next(ints_dev), next(floats_dev)
        x.index_put_((rows, ids), vals, accumulate=True)
    if masked:
        rows, ids = next(ints_dev), next(ints_dev)
        x[rows, ids] = float("-inf")
    if pen:
        rows, where, coef = next(ints_dev), next(ints_dev), next(floats_dev).view(-1, 3)  # [R], [R], [R, 3]
        y = x[rows]  # [R, V]
        c = counts.counts[where]  # [R, V] int32
        seen = (c > 0) | counts.prompt[where]
        r = coef[:, 0:1]
        y = torch.where(seen, torch.where(y > 0, y / r, y * r), y)
        y = y - c.float() * coef[:, 1:2] - (c > 0).float() * coef[:, 2:3]
        x[rows] = y
    return x
