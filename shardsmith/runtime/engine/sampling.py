"""Next-token choice on rank 0: greedy, temperature, top-k, top-p, per-request seed, logprobs.

Only rank 0 samples; the token reaches the other ranks as the payload of the next step's command,
so every rank sees the same sequence by construction. Logprobs are of the model's own distribution
(``log_softmax`` of the raw float32 logits, before temperature / top-k / top-p), as OpenAI and vLLM
report them.

Order of the filters (as transformers' ``generate`` and vLLM): temperature, then top-k, then top-p
(the smallest set of most likely tokens whose probability reaches ``top_p``; the most likely token
is always kept). ``temperature == 0`` is greedy and ignores the rest. Legend: V = vocabulary.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to continue one prompt.

    Attributes:
        max_tokens: tokens to generate (>= 1); temperature: 0 greedy, else softmax temperature;
        top_k: 0 for all; top_p: nucleus mass in (0, 1]; seed: per-request seed (None: random);
        stop_token_ids: ids that end the generation (the stop token is yielded, finish "stop");
        logprobs: how many top logprobs per step (0: none).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = 0


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One generated token.

    Attributes:
        token_id, logprob: the token and its model log-probability (nats);
        top_logprobs: ``(token_id, logprob)`` best first (``SamplingParams.logprobs`` of them);
        finished: last token of this generation; finish_reason: ``stop``, ``length`` or None.
    """

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]
    finished: bool
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class Choice:
    """One sampled token.

    Attributes:
        token_id: the token; logprob: its log-probability under the model (nats).
        top_logprobs: the ``n`` most likely ``(token_id, logprob)`` pairs, best first.
    """

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (a fresh random seed when ``None``)."""
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else secrets.randbits(63))
    return g


def filter_logits(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Scaled and masked logits ``[V]`` (masked entries ``-inf``) to sample from.

    Args:
        logits: ``[V]`` float32; temperature: > 0; top_k: keep the k best (0: all);
        top_p: keep the nucleus of mass ``top_p`` (1.0: all).
    """
    x = logits / temperature
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the better tokens
        drop = before >= top_p
        drop[0] = False
        x = x.clone()
        x[order[drop]] = float("-inf")
    return x


def choose(logits: torch.Tensor, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None, logprobs: int = 0) -> Choice:
    """Pick the next token from ``logits`` ``[V]`` (float32).

    Args:
        temperature: 0 for greedy (argmax, lowest id on ties), else the softmax temperature.
        top_k, top_p: filters as :func:`filter_logits`; generator: the request's random stream.
        logprobs: how many ``top_logprobs`` to return (0: none).

    Returns:
        the :class:`Choice`.
    """
    logits = logits.float()
    if temperature <= 0.0:
        token = int(torch.argmax(logits))
    else:
        probs = torch.softmax(filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p), dim=-1)
        token = int(torch.multinomial(probs, 1, generator=generator))
    lp = torch.log_softmax(logits, dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if logprobs > 0:
        vals, ids = torch.topk(lp, min(logprobs, lp.shape[-1]))
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return Choice(token, float(lp[token]), top)
