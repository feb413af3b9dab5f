"""Speculative decoding: a draft of ``k`` tokens per sequence, checked in one forward.

Two draft sources (:class:`SpeculativeConfig` ``method``):

- ``ngram`` (prompt lookup, every family): no draft model, the draft is copied from earlier text of
  the same sequence.
- ``mtp`` (DeepSeek-V3): the checkpoint's multi-token-prediction layer, loaded beside the model,
  proposes the tokens (``DeepseekV3.draft``); its cache is filled by every forward of the sequence.

N-gram drafts: when a greedy sequence's last ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``) occurred
earlier in its prompt or output, the ``k`` tokens that followed that occurrence are the draft
(:func:`ngram_draft`; text edits, code and quotes repeat their input). The scheduler feeds the
pending token and the draft as consecutive rows of the sequence's slot in the batched decode step
(a verify run; where the model's step takes none, or for MTP drafts, as one ``k + 1``-token prefill
chunk of the sequence), and takes the model's own greedy choices after each position for as long
as the draft agreed with them (:func:`accepted`): the first choice always counts, so a step gives 1
to ``k + 1`` tokens, each the token greedy decoding gives at that position. Positions past the
accepted ones hold the rejected draft; a family whose state is position-indexed (``rewinds``)
simply writes over them with the next step. DeepSeek-V4's window ring and compressors cannot be
recomputed from positions: a verify run's compressors keep what it writes over (a chunk's, after
``DeepseekV4.speculate``), and the engine's ``restore`` then takes the rejected rows back exactly
(the compressors retake the accepted rows; the ring, grown by ``k`` rows, needs nothing). The
logits of a run or a chunk equal one-token steps' up to matmul rounding, as a chunked prefill's do.

Sequences without penalties, logprobs or constraints speculate; the others decode as before in
the same step. A greedy sequence emits the verify forward's own greedy choices, so its output is
greedy decoding's. A sampled one (temperature, top-k, top-p, min-p) goes through speculative
sampling (:func:`sample_verified`): both draft sources propose one token per position (a point
mass ``q = 1[x]``), so draft token ``x`` is accepted with probability ``min(1, p(x) / q(x)) = p(x)``
under the target's filtered distribution ``p``, and at the first rejection the token is drawn from
the residual ``max(0, p - q)``, normalised: ``p`` without ``x``. Each emitted token is distributed
exactly as ``p`` (``P(y) = p(x) 1[y = x] + (1 - p(x)) p(y) 1[y != x] / (1 - p(x))``); after ``k``
acceptances one more token is drawn from the last row. The uniforms come from the request's own
generator, so a seeded request repeats itself. Sources: Saxena's prompt lookup decoding, as vLLM's
``ngram`` speculator uses it; the DeepSeek-V3 technical report's MTP modules, run as drafts as
vLLM's ``deepseek_mtp`` does; Leviathan et al., "Fast Inference from Transformers via Speculative
Decoding" (2023), and Chen et al., "Accelerating Large Language Model Decoding with Speculative
Sampling" (2023), for the acceptance rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from shardsmith.runtime.engine.sampling import SamplingParams, draw, draw_index, draw_sorted, sorted_filtered

__all__ = ["METHODS", "SpeculativeConfig", "SpecStats", "accepted", "ngram_draft", "sample_verified"]
METHODS = ("ngram", "mtp")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Attributes: method: the draft source (:data:`METHODS`, ``--speculative``); k: draft tokens per
    step (``--num-speculative-tokens``); min_ngram, max_ngram: lengths of the suffix ``ngram`` looks
    up (tokens)."""

    k: int = 4
    min_ngram: int = 1
    max_ngram: int = 4
    method: str = "ngram"

    def problems(self) -> list[str]:
        """What is out of range (a known ``method``, ``k`` in 1..16, ``1 <= min_ngram <= max_ngram``),
        one message each; empty when the config is valid."""
        out = [] if self.method in METHODS else [f"speculative must be one of {', '.join(METHODS)}, got {self.method!r}"]
        if not 1 <= self.k <= 16:
            out.append(f"num_speculative_tokens must be in 1..16, got {self.k}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            out.append(f"n-gram sizes need 1 <= min ({self.min_ngram}) <= max ({self.max_ngram})")
        return out


@dataclass
class SpecStats:
    """Counters since start. Attributes: steps: verify chunks run; drafted: draft tokens checked;
    accepted: draft tokens the model agreed with; emitted: tokens the verify chunks gave."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def ngram_draft(tokens: Sequence[int], cfg: SpeculativeConfig) -> list[int]:
    """Up to ``cfg.k`` tokens that followed the latest earlier occurrence of ``tokens``' last ``n``
    tokens (the longest ``n`` in ``[min_ngram, max_ngram]`` that occurred); ``[]`` when none did.
    One vectorised comparison per ``n`` over the whole history (this runs every decode step)."""
    arr = np.asarray(tokens, dtype=np.int64)
    L = arr.shape[0]
    for n in range(min(cfg.max_ngram, L - 1), cfg.min_ngram - 1, -1):
        # windows starting at 0 .. L-n-1 (each must end before the tail does), compared with the tail
        hits = np.flatnonzero((sliding_window_view(arr[:L - 1], n) == arr[L - n:]).all(axis=1))
        for start in hits[::-1]:  # latest first
            follow = arr[start + n:start + n + cfg.k]
            if follow.size:
                return follow.tolist()
    return []


def accepted(draft: Sequence[int], choices: Sequence[int]) -> int:
    """How many of ``choices`` (the model's greedy token after the pending token and after each
    draft token, ``len(draft) + 1`` of them) a verify step gives: the first, and one more for each
    leading draft token that equals the choice before it."""
    m = 0
    while m < len(draft) and draft[m] == choices[m]:
        m += 1
    return m + 1


def sample_verified(logits: torch.Tensor, draft: Sequence[int], params: SamplingParams,
                    generator: torch.Generator | None) -> list[int]:
    """Speculative sampling of a point-mass draft: the tokens a sampled sequence's verify step gives
    (1 to ``len(draft) + 1``), each distributed exactly as sampling from the target (module docstring).

    Args:
        logits: ``[k + 1, V]`` float32, row i the model's logits after the pending token and ``draft[:i]``;
        draft: the ``k`` proposed tokens; params: the request's sampling (temperature > 0, top-k,
        top-p, min-p: the filters of :func:`~shardsmith.runtime.engine.sampling.sorted_filtered`);
        generator: the request's random stream (one uniform per accept test, one per drawn token).
    """
    k, G = len(draft), logits.shape[0]
    full = lambda v, dtype=None: torch.full((G,), v, dtype=dtype)  # noqa: E731
    sx, order = sorted_filtered(logits.float(), full(params.temperature), full(params.top_k, torch.int64),
                                full(params.top_p, torch.float64), full(params.min_p) if params.min_p > 0 else None)
    probs = torch.zeros_like(sx).scatter_(1, order, torch.softmax(sx, dim=-1))  # [k + 1, V], vocabulary order
    at = torch.tensor(list(draft), dtype=torch.int64, device=probs.device)
    p_draft = probs[torch.arange(k, device=probs.device), at].tolist() if k else []
    out: list[int] = []
    for i, x in enumerate(draft):
        if draw(generator) < p_draft[i]:
            out.append(int(x))
            continue
        residual = probs[i].clone()
        residual[x] = 0.0
        if not bool((residual > 0).any()):  # p(x) rounds to 1 but the uniform landed past it: x after all
            out.append(int(x))
            continue
        u = torch.tensor([draw(generator)], dtype=torch.float64, device=probs.device)
        out.append(int(draw_index(residual[None], u)[0, 0]))
        return out
    u = torch.tensor([draw(generator)], dtype=torch.float64, device=probs.device)
    out.append(int(draw_sorted(sx[k:], order[k:], u)[0]))
    return out
