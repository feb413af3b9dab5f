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
greedy rows' argmax, sampled rows' filters and draw, log-probabilities and top logprobs are all
computed there and only ``B * (2 + 2n)`` numbers cross to the host, instead of the ``[B, V]``
logits (4 MB at B = 8 for a 129k vocabulary) and B host passes over them. A sampled token spends
one uniform from its request's own CPU generator (inverse transform sampling over the filtered
distribution, sorted best first, or in vocabulary order when nothing is filtered), so a seeded request draws the same tokens in any batch, and on
any device up to that device's rounding of the softmax; the draw does not depend on the device,
which lets the serving loop draw it before the step that needs it is launched.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardsmith.runtime.layers.staging import to_device


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to continue one prompt.

    Attributes:
        max_tokens: tokens to generate (>= 1); temperature: 0 greedy, else softmax temperature;
        top_k: 0 for all; top_p: nucleus mass in (0, 1]; seed: per-request seed (None: random);
        stop_token_ids: ids that end the generation (the stop token is yielded, finish "stop");
        logprobs: how many top logprobs per step (0: none);
        min_p: drop tokens whose probability is below ``min_p`` times the best's (0: none);
        min_tokens: the stop tokens are masked until this many tokens were generated;
        repetition_penalty, frequency_penalty, presence_penalty, logit_bias (``(token_id, bias)``
        pairs): :mod:`~shardsmith.runtime.engine.penalties` (1, 0, 0, (): off).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()


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


def param_problems(p: SamplingParams, vocab: int) -> list[str]:
    """Every range problem of ``p`` for a vocabulary of ``vocab`` tokens (the ranges vLLM takes),
    one line each; empty when ``p`` is good."""
    bad = [
        "max_tokens must be >= 1" if p.max_tokens < 1 else "",
        "temperature must be >= 0" if not p.temperature >= 0 else "",
        "top_k must be >= 0" if p.top_k < 0 else "",
        "top_p must be in (0, 1]" if not 0 < p.top_p <= 1 else "",
        "min_p must be in [0, 1]" if not 0 <= p.min_p <= 1 else "",
        "logprobs must be >= 0" if p.logprobs < 0 else "",
        f"min_tokens must be in [0, max_tokens={p.max_tokens}]" if not 0 <= p.min_tokens <= p.max_tokens else "",
        "repetition_penalty must be > 0" if not p.repetition_penalty > 0 else "",
        "frequency_penalty must be in [-2, 2]" if not -2 <= p.frequency_penalty <= 2 else "",
        "presence_penalty must be in [-2, 2]" if not -2 <= p.presence_penalty <= 2 else "",
        f"logit_bias token ids must be in [0, {vocab})" if any(not 0 <= t < vocab for t, _ in p.logit_bias) else "",
        "logit_bias values must be in [-100, 100]" if any(not -100 <= v <= 100 for _, v in p.logit_bias) else "",
    ]
    return [b for b in bad if b]


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (a fresh random seed when ``None``)."""
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else secrets.randbits(63))
    return g


def filter_logits(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Scaled and masked logits ``[V]`` (masked entries ``-inf``; shifted so the best is 0) to sample
    from, in vocabulary order (:func:`sorted_filtered` for one row).

    Args:
        logits: ``[V]`` float32; temperature: > 0; top_k: keep the k best, ties with the k-th
            included (0: all); top_p: keep the nucleus of mass ``top_p`` (1.0: all).
    """
    sx, order = sorted_filtered(logits.float()[None], torch.tensor([temperature]), torch.tensor([top_k]),
                                torch.tensor([top_p], dtype=torch.float64))
    return torch.empty_like(sx).scatter_(1, order, sx)[0]


def sorted_filtered(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` ``[G, V]`` (float32) scaled by its temperature (:func:`tempered`), sorted best first (stable:
    equal values in ascending id) and masked by its top-k, then its top-p, then its min-p (``-inf``);
    with the sort's order. Per-row settings are ``[G]`` tensors on any device (top_k 0: all; top_p
    1.0: all; min_p 0 or None: none).

    The kept entries are a prefix of each sorted row: top-k keeps every value at least the k-th's
    (ties included), top-p the smallest prefix whose probability reaches ``top_p`` (the best token
    always stays), computed on the top-k-masked row, as transformers and vLLM order them; min-p
    keeps the tokens whose probability is at least ``min_p`` times the best's (transformers'
    ``MinPLogitsWarper``; the ratio does not change with the tokens the other filters removed).

    Returns:
        ``(sorted_masked [G, V] float32, order [G, V] int64)``: ``sorted_masked[g, i]`` is the
        scaled logit of token ``order[g, i]``, or ``-inf``.
    """
    dev = x.device
    t, k, p = (v.to(dev, non_blocking=True) for v in (temperature, top_k, top_p))
    sx, order = torch.sort(tempered(x, t), dim=-1, descending=True, stable=True)
    V = x.shape[-1]
    k = torch.where((k > 0) & (k < V), k, V).long()
    kth = sx.gather(1, (k - 1)[:, None])
    sx = sx.masked_fill(sx < kth, float("-inf"))
    probs = torch.softmax(sx, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the better tokens
    drop = (before >= p[:, None].to(probs.dtype)) & (p < 1.0)[:, None]
    if min_p is not None:  # p_i / p_best = exp(sx_i) (the best is 0 after tempered)
        drop |= sx < torch.log(min_p.to(dev, non_blocking=True).to(sx.dtype))[:, None]
    drop[:, 0] = False
    return sx.masked_fill(drop, float("-inf")), order


def tempered(x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``(x - rowmax) / temperature`` per row of ``x`` ``[G, V]`` (float32 out; ``temperature`` ``[G]``,
    > 0), divided in float64: the best entry is 0 and the rest finite or ``-inf`` for any positive
    temperature, however small (a float32 ``x / 1e-39`` overflows, and ``1e-46`` is 0 in float32);
    the shift changes no softmax, top-k or top-p."""
    shifted = (x - x.max(dim=-1, keepdim=True).values).double()
    return (shifted / temperature.double()[:, None]).to(x.dtype)


def draw_index(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse transform sampling: per row of ``probs`` ``[G, V]`` (rows summing to about 1, in any
    order) the first column whose cumulative probability passes ``u[g]`` times the row's total
    (``u`` ``[G]`` in ``[0, 1)``), never past the last column of nonzero probability. ``[G, 1]`` int64."""
    cdf = torch.cumsum(probs, dim=-1)
    idx = torch.searchsorted(cdf, (u.to(cdf.dtype) * cdf[:, -1])[:, None], right=True)
    V = probs.shape[-1]
    last = V - 1 - torch.argmax(torch.flip(probs > 0, dims=[-1]).to(torch.uint8), dim=-1, keepdim=True)
    return torch.minimum(idx, last)


def draw_sorted(sx: torch.Tensor, order: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of :func:`sorted_filtered`'s output (:func:`draw_index` over the sorted,
    masked row; never a masked token). Returns ``[G]`` int64 token ids."""
    return order.gather(1, draw_index(torch.softmax(sx, dim=-1), u))[:, 0]


def draw(generator: torch.Generator | None) -> float:
    """The uniform in ``[0, 1)`` a sampled token spends from its request's generator (float64)."""
    return float(torch.rand((), generator=generator, dtype=torch.float64))


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
    """Pick the next token from ``logits`` ``[V]`` (float32): :func:`choose_rows` for one row.

    Args:
        temperature: 0 for greedy (argmax, lowest id on ties), else the softmax temperature.
        top_k, top_p: filters as :func:`filter_logits`; generator: the request's random stream.
        logprobs: how many ``top_logprobs`` to return (0: none).

    Returns:
        the :class:`Choice`.
    """
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, logprobs=logprobs)
    return choose_rows(logits[None], [params], [generator])[0]


def choose_on_device(logits: torch.Tensor, params: Sequence[SamplingParams], draws: Sequence[float], *,
                     scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Every row's choice, computed where ``logits`` ``[B, V]`` are; nothing waits for the device
    (unless a tie in the top logprobs reaches past :func:`top_logprobs`' window). ``scores``: the
    logits the tokens are chosen from when they differ from the model's (penalties, bias:
    :func:`~shardsmith.runtime.engine.penalties.apply`); log-probabilities stay the model's.

    Greedy rows (``temperature <= 0``): argmax, lowest id on ties. Sampled rows: ``draws[b]`` (a
    uniform from the request's generator, :func:`draw`; ignored for greedy rows) through
    :func:`sorted_filtered` and :func:`draw_sorted`, or, for a row with neither top-k nor top-p,
    through :func:`draw_index` over its tempered softmax in vocabulary order (no sort). Which way a
    row goes depends only on its own parameters. Log-probabilities are of the raw logits.

    Returns:
        ``(ids [B] int64, packed [B, 2 + 2n] float64, n)``, on ``logits``' device: each row's token,
        then its log-probability, then the ids and log-probabilities of the top ``n`` (the most any
        row asks for), as :func:`unpack_choices` reads them.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    x = logits.float() if scores is None else scores.float()
    ids = torch.argmax(x, dim=-1)  # [B]
    V = x.shape[-1]
    plain = [b for b, p in enumerate(params)
             if p.temperature > 0.0 and not 0 < p.top_k < V and p.top_p >= 1.0 and p.min_p <= 0.0]
    filtered = [b for b, p in enumerate(params) if p.temperature > 0.0 and b not in plain]
    for group in (plain, filtered):  # unfiltered rows skip the sort: [B, V] sorts cost ms on a CPU
        if not group:
            continue
        host = torch.tensor([[draws[b], params[b].temperature, params[b].top_k, params[b].top_p, params[b].min_p]
                             for b in group], dtype=torch.float64)
        meta = to_device([host.flatten()], x.device)[0].view(-1, 5)  # [S, 5]: draw, temperature, top_k, top_p, min_p
        where = None if len(group) == len(params) else to_device([torch.tensor(group)], x.device)[0]
        rows = x if where is None else x[where]
        if group is plain:
            tok = draw_index(torch.softmax(tempered(rows, meta[:, 1]), dim=-1), meta[:, 0])[:, 0]
        else:
            tok = draw_sorted(*sorted_filtered(rows, meta[:, 1], meta[:, 2].long(), meta[:, 3], meta[:, 4]), meta[:, 0])
        ids = tok if where is None else ids.index_copy(0, where, tok)
    ids = ids[:, None]
    cols = [ids.double(), lp.gather(1, ids).double()]
    n = min(max(p.logprobs for p in params), lp.shape[-1])
    if n > 0:
        vals, top_ids = top_logprobs(lp, n)
        cols += [top_ids.double(), vals.double()]
    return ids[:, 0], torch.cat(cols, dim=1), n


def unpack_choices(rows: list[list[float]], params: Sequence[SamplingParams], n: int) -> list[Choice]:
    """The :class:`Choice` of each row of :func:`choose_on_device`'s ``packed``, on the host (row b
    keeps its own ``params[b].logprobs`` of the ``n``)."""
    out = []
    for row, p in zip(rows, params):
        k = min(p.logprobs, n)
        out.append(Choice(int(row[0]), row[1], tuple(zip((int(t) for t in row[2:2 + k]), row[2 + n:2 + n + k]))))
    return out


def choose_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None], *, scores: torch.Tensor | None = None) -> list[Choice]:
    """Pick each row's next token from a batched step's logits ``[B, V]`` on any device: each sampled
    row spends one uniform from ``generators[b]`` (:func:`draw`), every row is chosen where the logits
    are (:func:`choose_on_device`) and one ``[B, 2 + 2n]`` float64 tensor comes back (n = the most
    top logprobs any row asks for). Row b's result does not depend on the other rows.

    Args:
        logits: ``[B, V]`` (any float dtype; reduced in float32). params: per row, its
        :class:`SamplingParams`; generators: per row, its random stream (used by sampled rows);
        scores: the adjusted logits to choose from (:func:`choose_on_device`).

    Returns:
        B :class:`Choice`, row order.

    Raises:
        ValueError: ``params`` or ``generators`` not of length B.
    """
    B = logits.shape[0]
    if len(params) != B or len(generators) != B:
        raise ValueError(f"choose_rows: {B} rows of logits but {len(params)} params and {len(generators)} generators")
    draws = [draw(g) if p.temperature > 0.0 else 0.0 for p, g in zip(params, generators)]
    _, packed, n = choose_on_device(logits, params, draws, scores=scores)
    return unpack_choices(packed.cpu().tolist(), params, n)  # the step's one device-to-host copy
