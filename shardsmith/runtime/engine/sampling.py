"""Next-token choice on rank 0: greedy, temperature, top-k, top-p, per-request seed, logprobs.

Only rank 0 samples; the token reaches the other ranks as the payload of the next step's command,
so every rank sees the same sequence by construction. Logprobs are of the model's own distribution
(``log_softmax`` of the raw float32 logits, before temperature / top-k / top-p), as OpenAI and vLLM
report them.

Order of the filters (as transformers' ``generate`` and vLLM): temperature, then top-k, then top-p
(the smallest set of most likely tokens whose probability reaches ``top_p``; the most likely token
is always kept). ``temperature == 0`` is greedy and ignores the rest. Legend: B = rows of a step,
V = vocabulary.

A batched step's rows are chosen together by :func:`choose_rows` where the logits are (the GPU):
greedy rows' argmax, log-probability and top logprobs are reduced there and only ``B * (2 + 2n)``
numbers cross to the host, instead of the ``[B, V]`` logits (4 MB at B = 8 for a 129k vocabulary)
and B host passes over them. Rows that sample copy their own row and use :func:`choose` with the
request's CPU generator, so a seeded request draws the same tokens on any device and in any batch.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
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


def top_logprobs(lp: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` best entries of each row of ``lp`` ``[..., V]`` (float32): ``(values, ids)``, each
    ``[..., min(n, V)]``, best first and equal values in ascending id, so a row's answer does not
    depend on ``n`` or on the other rows (``torch.topk`` leaves the order of ties unspecified, and
    ties are common in logits computed in bfloat16).

    A ``topk`` of ``n + 16`` candidates, ordered by an exact int64 key (the float's order-preserving
    integer image in the high 32 bits, ``2**32 - 1 - id`` in the low 32); when more than 16 values
    tie at the n-th place the whole row is keyed instead (one host sync to find out).
    """
    V = lp.shape[-1]
    n = min(n, V)
    window = min(V, n + _TIE_WINDOW)
    cand_vals, cand_ids = torch.topk(lp, window, dim=-1)  # best first; ties in no particular order
    if window < V and bool((cand_vals[..., n - 1] == cand_vals[..., -1]).any()):  # a tie may reach past the window
        ids = torch.topk(_order_key(lp, torch.arange(V, device=lp.device).expand_as(lp)), n, dim=-1).indices
        return lp.gather(-1, ids), ids
    pick = torch.topk(_order_key(cand_vals, cand_ids), n, dim=-1).indices
    return cand_vals.gather(-1, pick), cand_ids.gather(-1, pick)


_TIE_WINDOW = 16


def _order_key(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys ordering ``x`` (float32) descending, then ``ids`` ascending."""
    bits = x.float().contiguous().view(torch.int32).long()
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) * 2**32 + (2**32 - 1 - ids)


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
        vals, ids = top_logprobs(lp, logprobs)
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return Choice(token, float(lp[token]), top)


def greedy_on_device(logits: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Greedy rows' choices, computed where ``logits`` ``[G, V]`` are, nothing brought to the host
    (unless a tie in the top logprobs reaches past :func:`top_logprobs`' window).

    Returns:
        ``(ids [G] int64, packed [G, 2 + 2n] float64, n)``, on ``logits``' device: each row's token
        (argmax, lowest id on ties), then its log-probability, then the ids and log-probabilities
        of the top ``n`` (the most any row asks for), as :func:`unpack_greedy` reads them.
    """
    x = logits.float()
    lp = torch.log_softmax(x, dim=-1)  # [G, V]
    ids = torch.argmax(x, dim=-1, keepdim=True)  # [G, 1]
    cols = [ids.double(), lp.gather(1, ids).double()]
    n = min(max(p.logprobs for p in params), lp.shape[-1])
    if n > 0:
        vals, top_ids = top_logprobs(lp, n)
        cols += [top_ids.double(), vals.double()]
    return ids[:, 0], torch.cat(cols, dim=1), n


def unpack_greedy(rows: list[list[float]], params: Sequence[SamplingParams], n: int) -> list[Choice]:
    """The :class:`Choice` of each row of :func:`greedy_on_device`'s ``packed``, on the host (row b
    keeps its own ``params[b].logprobs`` of the ``n``)."""
    out = []
    for row, p in zip(rows, params):
        k = min(p.logprobs, n)
        out.append(Choice(int(row[0]), row[1], tuple(zip((int(t) for t in row[2:2 + k]), row[2 + n:2 + n + k]))))
    return out


def choose_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> list[Choice]:
    """Pick each row's next token from a batched step's logits ``[B, V]`` on any device.

    Greedy rows (``temperature <= 0``) are reduced on ``logits``' device (argmax with the lowest id
    on ties, as :func:`choose`; log-probability of the token and the top ``logprobs`` from one
    ``log_softmax``), and one ``[B, 2 + 2n]`` float64 tensor comes back (n = the most top logprobs
    any row asks for). A sampled row's logits are copied to the host and go through :func:`choose`
    with ``generators[b]``. Row b's result equals ``choose(logits[b].cpu(), ...)``: exactly on CPU,
    and up to the device's reduction rounding in the logprobs on a GPU.

    Args:
        logits: ``[B, V]`` (any float dtype; reduced in float32). params: per row, its
        :class:`SamplingParams`; generators: per row, its random stream (used by sampled rows).

    Returns:
        B :class:`Choice`, row order.

    Raises:
        ValueError: ``params`` or ``generators`` not of length B.
    """
    B = logits.shape[0]
    if len(params) != B or len(generators) != B:
        raise ValueError(f"choose_rows: {B} rows of logits but {len(params)} params and {len(generators)} generators")
    out: list[Choice | None] = [None] * B
    greedy = [b for b, p in enumerate(params) if p.temperature <= 0.0]
    if greedy:
        x = logits if len(greedy) == B else logits[torch.tensor(greedy, device=logits.device)]
        _, packed, n = greedy_on_device(x, [params[b] for b in greedy])
        for b, c in zip(greedy, unpack_greedy(packed.cpu().tolist(), [params[b] for b in greedy], n)):
            out[b] = c  # the step's one device-to-host copy
    for b, p in enumerate(params):
        if out[b] is None:
            out[b] = choose(logits[b].cpu(), temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                            generator=generators[b], logprobs=p.logprobs)
    return out  # type: ignore[return-value]
