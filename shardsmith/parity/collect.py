"""Rank 0's side of a parity run: greedy decode, reference prefill and layer outputs, via hooks.

Nothing here edits a model: the engine's model is observed through PyTorch forward hooks, one on
the model itself (its output is the step's float32 logits ``[T or 1, V]``, gathered over the
vocabulary on every rank) and, with ``layers``, one per decoder layer (its output is the hidden
state after the layer, ``[T, D]`` or, for DeepSeek-V4's hyper-connections, ``[T, m, D]``; at
TP > 1 it is replicated on every rank after the layer's all-reduce, so rank 0's copy is the
whole state). Legend: N = generated tokens, K = probed tokens, V = vocabulary, T = positions.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from shardsmith.errors import RuntimeLoadError
from shardsmith.parity.compare import Trace

LAYER_LISTS = ("model.layers", "layers")  # Mixtral family, V3, gpt-oss / DeepSeek-V4 (and transformers: model.layers)


@dataclass(frozen=True, slots=True)
class Probe:
    """What a configuration after the first is given: the first one's run of a prompt.

    Attributes:
        tokens: ``[N]`` the first configuration's greedy tokens (the teacher-forced continuation);
        top_ids: ``[N, K]`` its top-K per step (the tokens whose log-probs every run reports).
    """

    tokens: list[int]
    top_ids: torch.Tensor


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers (``model.layers`` or ``layers``).

    Raises:
        RuntimeLoadError: the model has neither (a family this tool does not know).
    """
    for name in LAYER_LISTS:
        try:
            mod = model.get_submodule(name)
        except AttributeError:
            continue
        if isinstance(mod, nn.ModuleList):
            return mod
    raise RuntimeLoadError(f"{type(model).__name__}: no decoder layer list at {' or '.join(LAYER_LISTS)}; "
                           "parity --layers cannot hook it")


@contextmanager
def recording(module: nn.Module, sink: list[torch.Tensor], *, last_row: bool) -> Iterator[None]:
    """Append ``module``'s output (first element of a tuple) to ``sink`` on CPU while in the block."""
    def hook(_mod: nn.Module, _inp: object, out: object) -> None:
        out = out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", out)
        sink.append((out[-1] if last_row else out).detach().to("cpu", copy=True))

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def recording_layers(model: nn.Module, sink: list[list[torch.Tensor]]) -> Iterator[None]:
    """Per decoder layer, record its outputs into ``sink[layer]`` while in the block."""
    layers = decoder_layers(model)
    sink[:] = [[] for _ in layers]
    handles = []
    for i, layer in enumerate(layers):
        def hook(_mod: nn.Module, _inp: object, out: object, i: int = i) -> None:
            out = out[0] if isinstance(out, (tuple, list)) else out
            sink[i].append(out.detach().to("cpu", copy=True))
        handles.append(layer.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _top(lp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    vals, ids = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
    return ids, vals


def greedy(engine, prompt: list[int], *, max_tokens: int, top_k: int,
           probe: Probe | None) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy decode in the engine's dtype, recording every step's full log-softmax.

    Returns:
        ``(tokens [N], top_ids [N, K], top_lp [N, K], probe_ids [N, K], probe_lp [N, K])``; the probe
        is the first configuration's top-K (``probe``) or, for the first, this run's own.
    """
    from shardsmith.runtime.engine.engine import SamplingParams

    rows: list[torch.Tensor] = []
    with recording(engine.model, rows, last_row=True):
        tokens = [s.token_id for s in engine.generate(prompt, SamplingParams(max_tokens=max_tokens))]
    if len(rows) != len(tokens) or any(int(r.argmax()) != t for r, t in zip(rows, tokens)):
        raise RuntimeLoadError(f"{type(engine.model).__name__}: the output hook saw {len(rows)} steps for "
                               f"{len(tokens)} greedy tokens, or logits whose argmax is not the token chosen; "
                               "parity needs the model's output to be the step's logits")
    lp = torch.stack(rows).double().log_softmax(dim=-1)  # [N, V]
    top_ids, top_lp = _top(lp, top_k)
    probe_ids = top_ids if probe is None else probe.top_ids
    n = min(len(tokens), probe_ids.shape[0])
    probe_lp = torch.full(probe_ids.shape, float("nan"), dtype=torch.float64)
    probe_lp[:n] = lp[:n].gather(1, probe_ids[:n])
    return tokens, top_ids, top_lp, probe_ids, probe_lp


def teacher_forced(engine, prompt: list[int], tokens: list[int], probe_ids: torch.Tensor, *,
                   layers: bool) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """One prefill of ``prompt + tokens``: log-probs of ``probe_ids`` per step ``[N, K]`` and, with
    ``layers``, every decoder layer's output over the ``T`` positions."""
    sink: list[list[torch.Tensor]] = []
    seq = list(prompt) + list(tokens)
    if layers:
        with recording_layers(engine.model, sink):
            logits = engine.logits(seq)
    else:
        logits = engine.logits(seq)  # [T, V]
    lp = logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)].double().log_softmax(dim=-1)  # [N, V]
    hidden = [torch.cat(s) if len(s) > 1 else s[0] for s in sink] if layers else None
    return lp.gather(1, probe_ids[: len(tokens)]), hidden


def dtype_phase(engine, prompts: list[list[int]], *, max_tokens: int, top_k: int, probes: list[Probe] | None,
                layers: bool) -> list[dict]:
    """Rank 0, compute dtype: greedy decode of every prompt (and, with ``layers``, the teacher-forced
    layer outputs). ``probes``: one per prompt from the first configuration; None for the first.

    Returns:
        per prompt the fields of :class:`Trace` known so far plus ``forced`` (the teacher-forced tokens).
    """
    runs = []
    for i, prompt in enumerate(prompts):
        probe = probes[i] if probes else None
        tokens, top_ids, top_lp, probe_ids, probe_lp = greedy(engine, prompt, max_tokens=max_tokens,
                                                              top_k=top_k, probe=probe)
        forced = probe.tokens if probe else tokens
        hidden = teacher_forced(engine, prompt, forced, probe_ids, layers=True)[1] if layers else None
        runs.append(dict(tokens=tokens, top_ids=top_ids, top_lp=top_lp, probe_ids=probe_ids, probe_lp=probe_lp,
                         hidden=hidden, forced=forced))
    return runs


def reference_phase(engine, prompts: list[list[int]], runs: list[dict], *, layers: bool) -> list[Trace]:
    """Rank 0, reference precision: one teacher-forced prefill per prompt; completes the traces."""
    traces = []
    for prompt, run in zip(prompts, runs):
        run = dict(run)
        forced = run.pop("forced")
        ref_lp, hidden_ref = teacher_forced(engine, prompt, forced, run["probe_ids"], layers=layers)
        full = torch.full(run["probe_ids"].shape, float("nan"), dtype=torch.float64)
        full[: ref_lp.shape[0]] = ref_lp
        traces.append(Trace(ref_lp=full, hidden_ref=hidden_ref, **run))
    return traces
