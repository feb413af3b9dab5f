"""Compare greedy runs of one model under several configurations: first divergence, noise, verdict.

Pure functions over what each configuration's rank 0 recorded (:class:`Trace`); no ranks, no
model. Legend: N = generated tokens, K = probed tokens per step (the first configuration's top-K),
T = positions of the teacher-forced sequence (prompt + the first configuration's tokens).

The noise estimate. Every configuration is run twice with the same weights and ranks: in the
compute dtype (greedy, decode steps: what serving runs) and in a reference precision (float32 for
bfloat16/float16 runs, float64 for float32 runs; one teacher-forced prefill of the first
configuration's sequence). Changing the precision changes every rounding and therefore the
effective reduction order of every sum, so ``n_C = max_K |lp_C,dtype - lp_C,ref|`` (nats) is how
far configuration C's own arithmetic moves its log-probs at that step. Two correct
configurations A and B satisfy, by the triangle inequality,
``|lp_A - lp_B| <= n_A + n_B + |lp_A,ref - lp_B,ref|``, and the last term is rounding of the
reference precision, orders of magnitude below ``n_A + n_B``. Hence the verdict at a divergence:

- **near-tie** when (1) the flip fits in the noise: the margin by which the two choices trade
  places, ``(lp_A(a) - lp_A(b)) + (lp_B(b) - lp_B(a))`` (a, b = the tokens A and B chose), is at
  most ``2 (n_A + n_B)``, and (2) at every step up to and including it the two configurations
  agree in the reference precision within that step's noise: ``max_K |lp_A,ref - lp_B,ref| <= n_A + n_B``;
  ``n_B`` counts at most :data:`NOISE_RATIO` (4) times ``n_A``: the configurations run the same
  algorithm in the same dtype and differ only in the split, so their rounding noise is of one
  size; a ``B`` whose dtype run departs from its own reference far more than that has a defect
  on its dtype path only (a kernel, a cast), which must not pass as noise. An *independent*
  configuration (transformers' model: another implementation of the same function) counts its
  noise in full: it rounds in other places (DeepSeek-V3's router scores in bfloat16, for one), and
  where such a rounding flips a discrete choice (an expert, a top-k group) its dtype run departs
  from its own reference by nats at once. That is still rounding, proven by (2): the two
  reference-precision runs agree at every step, which no defect of ours survives;
- **defect** otherwise: the configurations compute different functions, not differently
  rounded ones. A prompt without a divergence is checked by (2) over all steps (``agree`` or
  ``defect``).

The engine's models return float32 logits in every dtype, so a float64 reference is good to the
float32 rounding of the logits (about 1e-7 nats at logits of order 1); the float32 noise it is
compared with is typically 10-100 times larger. Per layer the reference has full float64.

Per layer (``--layers``) the same rule on relative errors of the decoder layers' outputs: a layer
*departs* when the reference-precision relative error between the configurations exceeds the sum
of both configurations' own dtype-vs-reference relative errors at that layer (:class:`LayerError`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NOISE_RATIO = 4.0  # another configuration's own noise counts up to this many times the first's

@dataclass(frozen=True, slots=True)
class Trace:
    """What one configuration recorded for one prompt (rank 0).

    Attributes:
        tokens: ``[N]`` greedy tokens in the compute dtype.
        top_ids, top_lp: ``[N, K]`` int64 / float64: this configuration's own top-K per step
            (log-probs in nats, best first).
        probe_ids: ``[N, K]`` the probed tokens: the first configuration's ``top_ids``.
        probe_lp: ``[N, K]`` float64 log-probs of ``probe_ids`` in the compute dtype (decode steps).
        ref_lp: ``[N, K]`` float64 log-probs of ``probe_ids`` in the reference precision, teacher-
            forced on the first configuration's tokens (valid up to this run's first divergence).
        hidden, hidden_ref: per decoder layer its output over ``[T, ...]`` (compute dtype /
            reference precision), teacher-forced; None without ``--layers``.
    """

    tokens: list[int]
    top_ids: torch.Tensor
    top_lp: torch.Tensor
    probe_ids: torch.Tensor
    probe_lp: torch.Tensor
    ref_lp: torch.Tensor
    hidden: list[torch.Tensor] | None = None
    hidden_ref: list[torch.Tensor] | None = None


@dataclass(frozen=True, slots=True)
class Divergence:
    """One prompt under one configuration compared with the first configuration.

    Attributes:
        prompt: prompt index; config: the compared configuration's name.
        step: index of the first generated token that differs (None: all N agree; the checks
            then cover every step). first_token, other_token: the two choices there (None, None).
        gaps: top-2 log-prob gap (nats) at ``step`` for every configuration whose context there
            equals the first's (it has not diverged earlier); margin: the flip margin (nats; a
            lower bound when ``other_token`` is outside the first's top-K).
        max_diff: ``max_K |lp_first - lp_other|`` at the step (nats, compute dtype).
        noise: ``n_first + n_other`` at the step (nats); ref_diff: the largest reference-precision
            difference over steps ``<= step``, and ref_noise: that step's noise.
        verdict: ``agree``, ``near-tie`` or ``defect``; reason: one line saying why.
    """

    prompt: int
    config: str
    step: int | None
    first_token: int | None
    other_token: int | None
    gaps: dict[str, float]
    margin: float | None
    max_diff: float
    noise: float
    ref_diff: float
    ref_noise: float
    verdict: str
    reason: str


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token of two greedy runs (over the shorter), or None."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def step_noise(t: Trace) -> torch.Tensor:
    """``[N]`` this configuration's own rounding noise per step: ``max_K |probe_lp - ref_lp|`` (nats)."""
    return (t.probe_lp - t.ref_lp).abs().amax(dim=-1)


def gap(t: Trace, step: int) -> float:
    """Top-2 log-prob gap (nats) of ``t`` at ``step`` (inf with a single probed token)."""
    lp = t.top_lp[step]
    return float(lp[0] - lp[1]) if lp.numel() > 1 else math.inf


def _lp_of(t: Trace, step: int, token: int) -> float | None:
    """``t``'s compute-dtype log-prob of ``token`` at ``step`` when it is among its own or the probed top-K."""
    for ids, lps in ((t.top_ids, t.top_lp), (t.probe_ids, t.probe_lp)):
        hit = (ids[step] == token).nonzero()
        if hit.numel():
            return float(lps[step, hit[0, 0]])
    return None


def compare(prompt: int, names: list[str], traces: list[Trace], *,
            independent: frozenset[str] = frozenset()) -> list[Divergence]:
    """Compare each configuration's trace of one prompt with the first one's (``traces[0]``).

    Args:
        prompt: the prompt's index (for the report); names: configuration names, ``traces`` order.
        independent: names of configurations that are another implementation (transformers): their
            own noise counts in full, not capped at :data:`NOISE_RATIO` times the first's.

    Returns:
        one :class:`Divergence` per configuration after the first.
    """
    first, n0 = traces[0], step_noise(traces[0])
    firsts = [first_divergence(first.tokens, t.tokens) for t in traces]
    out = []
    for name, t, p in zip(names[1:], traces[1:], firsts[1:]):
        own = step_noise(t)
        noise = n0 + (own if name in independent else torch.minimum(own, NOISE_RATIO * n0))  # [N]
        last = p if p is not None else min(len(first.tokens), len(t.tokens)) - 1
        ref = (first.ref_lp - t.ref_lp).abs().amax(dim=-1)[: last + 1]  # [<= N]
        worst = int(torch.argmax(ref / noise[: last + 1].clamp_min(1e-30)))
        ref_ok = bool((ref <= noise[: last + 1]).all())
        max_diff = float((first.probe_lp[last] - t.probe_lp[last]).abs().max())
        common = dict(max_diff=max_diff, noise=float(noise[last]), ref_diff=float(ref[worst]),
                      ref_noise=float(noise[worst]))
        if p is None:
            verdict, reason = ("agree", "same tokens; reference runs agree within the noise") if ref_ok else (
                "defect", f"same tokens, but at step {worst} the reference runs differ by "
                          f"{float(ref[worst]):.3g} nats, above the noise {float(noise[worst]):.3g}")
            out.append(Divergence(prompt, name, None, None, None, {}, None, verdict=verdict, reason=reason, **common))
            continue
        a, b = first.tokens[p], t.tokens[p]
        lp_a_b = _lp_of(first, p, b)
        below = lp_a_b is None  # b outside the first's top-K: its log-prob there is at most the K-th
        lp_a_b = float(first.top_lp[p, -1]) if below else lp_a_b
        margin = (float(first.top_lp[p, 0]) - lp_a_b) + (float(t.top_lp[p, 0]) - (_lp_of(t, p, a) or -math.inf))
        gaps = {n: gap(x, p) for n, x, q in zip(names, traces, firsts) if q is None or q >= p}
        if margin > 2 * float(noise[p]):
            verdict, reason = "defect", (f"flip margin {margin:.3g} nats exceeds twice the noise "
                                         f"({2 * float(noise[p]):.3g}){' (lower bound)' if below else ''}")
        elif not ref_ok:
            verdict, reason = "defect", (f"at step {worst} the reference runs differ by {float(ref[worst]):.3g} "
                                         f"nats, above the noise {float(noise[worst]):.3g}")
        else:
            verdict, reason = "near-tie", (f"flip margin {margin:.3g} <= 2 x noise {float(noise[p]):.3g}; "
                                           "reference runs agree")
        out.append(Divergence(prompt, name, p, a, b, gaps, margin, verdict=verdict, reason=reason, **common))
    return out


@dataclass(frozen=True, slots=True)
class LayerError:
    """One decoder layer of one configuration against the first, over every prompt's positions.

    Attributes:
        layer: index; rel_err: ``||h - h_first|| / ||h_first||`` in the compute dtype;
        noise: the two configurations' own dtype-vs-reference relative errors, summed (the
            other's counted up to :data:`NOISE_RATIO` times the first's);
        ref_err: the relative error between their reference-precision runs;
        departs: ``ref_err > noise`` (they compute different functions), or ``rel_err > noise +
            ref_err`` (more apart in the dtype than rounding and the reference gap allow: by the
            triangle inequality a correct pair cannot be).
    """

    layer: int
    rel_err: float
    noise: float
    ref_err: float
    departs: bool


def _rel(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    num = sum(float((x.double() - y.double()).pow(2).sum()) for x, y in pairs)
    den = sum(float(y.double().pow(2).sum()) for _, y in pairs)
    return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)


def layer_errors(first: list[Trace], other: list[Trace], *, independent: bool = False) -> list[LayerError]:
    """Per-layer relative errors of ``other`` against ``first`` (one trace per prompt, same order);
    ``independent``: ``other`` is another implementation, its own noise counted in full (:func:`compare`).

    Raises:
        ValueError: a trace without hidden states, or the two with different layer counts.
    """
    if any(t.hidden is None or t.hidden_ref is None for t in first + other):
        raise ValueError("layer_errors needs traces recorded with hidden states (--layers)")
    layers = len(first[0].hidden)
    if any(len(t.hidden) != layers for t in other):
        raise ValueError(f"layer counts differ: {layers} vs {[len(t.hidden) for t in other]}")
    rows = []
    for i in range(layers):
        rel = _rel([(o.hidden[i], f.hidden[i]) for f, o in zip(first, other)])
        n0 = _rel([(f.hidden[i], f.hidden_ref[i]) for f in first])
        own = _rel([(o.hidden[i], o.hidden_ref[i]) for o in other])
        noise = n0 + (own if independent else min(own, NOISE_RATIO * n0))
        ref = _rel([(o.hidden_ref[i], f.hidden_ref[i]) for f, o in zip(first, other)])
        rows.append(LayerError(i, rel, noise, ref, ref > noise or rel > noise + ref))
    return rows


def first_departing(rows: list[LayerError]) -> int | None:
    """The first layer whose output departs (see :class:`LayerError`), or None."""
    return next((r.layer for r in rows if r.departs), None)
