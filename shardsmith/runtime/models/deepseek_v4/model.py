"""The DeepSeek-V4 causal LM, built on ``meta`` from the rank's plan and filled from its weights.

Module paths mirror the release checkpoint (``layers.N.attn.wq_b.weight``), so loading is a strict
name-for-name assignment (:func:`assign_weights`) with three spelled-out renames:

=================================  =================================  ===========================
source tensor                      module buffer                      why
=================================  =================================  ===========================
``X.scale`` (UE8M0, FP8 weight)    ``X.weight_scale_inv`` (float32)   the parallel layers' name
``layers.N.hc_attn_fn`` (etc.)     ``layers.N.hc_attn.fn``            mixers are modules
``layers.N.ffn.experts.E.w1`` ...  ``layers.N.ffn.experts.gate_up``   expert banks
=================================  =================================  ===========================

``mtp.*`` draft layers stay in the pack and are not loaded. Every parallel layer comes from
:class:`~shardsmith.runtime.layers.parallel.Shards`; this file knows nothing about ranks. One sequence at a
time (batch 1); the state (sliding windows, compressor buffers and entries) continues from the
last position, so a step must start at 0 (a new sequence) or where the previous one ended.
Source of the maths: transformers ``modeling_deepseek_v4.py`` (``DeepseekV4Model``).

Legend: T = new tokens, m = hyper-connection streams, D = hidden, V = vocabulary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from shardsmith.errors import UsageError
from shardsmith.runtime.layers.experts import RoutedExperts
from shardsmith.runtime.layers.parallel import Shards, all_reduce
from shardsmith.runtime.layers.quant import ue8m0_to_float
from shardsmith.runtime.models.deepseek_v4.attention import Attention
from shardsmith.runtime.models.deepseek_v4.config import V4Args
from shardsmith.runtime.models.deepseek_v4.hyper import HyperHead, HyperMixer, expand
from shardsmith.runtime.models.deepseek_v4.moe import MoE
from shardsmith.runtime.models.deepseek_v4.ops import RMSNorm, inv_freq, rope_cos_sin
from shardsmith.runtime.models.mixtral.model import install_buffers

_HC = re.compile(r"(^|\.)hc_(attn|ffn|head)_(fn|base|scale)$")


class Block(nn.Module):
    """Decoder layer N: ``hc_attn`` -> attention -> ``hc_ffn`` -> MoE, on ``m`` residual streams."""

    def __init__(self, args: V4Args, shards: Shards, i: int, freqs: dict[str, torch.Tensor]) -> None:
        super().__init__()
        prefix = f"layers.{i}"
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args, shards, prefix + ".attn", i, freqs_main=freqs["main"],
                              freqs_compress=freqs["compress"])
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn = MoE(args, shards, prefix, i)
        self.hc_attn = HyperMixer(args.dim, args.hc_mult, args.hc_iters, args.hc_eps, args.norm_eps)
        self.hc_ffn = HyperMixer(args.dim, args.hc_mult, args.hc_iters, args.hc_eps, args.norm_eps)

    def forward(self, streams: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:  # [T, m, D]
        x, post, comb = self.hc_attn(streams)
        streams = expand(streams, self.attn(self.attn_norm(x), start), post, comb)
        x, post, comb = self.hc_ffn(streams)
        return expand(streams, self.ffn(self.ffn_norm(x), ids), post, comb)

    # The same layer as pieces around its attention, for a decode step run piece by piece
    # (engine/cuda_graphs.py's table): the same kernels in the same order as forward, so the same bits.

    @property
    def experts(self) -> RoutedExperts:
        """The routed experts."""
        return self.ffn.experts

    def attn_in_args(self, step: "Step") -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[1, r/2]``: this layer's RoPE table at the step's position."""
        return step.rope(self.attn)

    def attn_in(self, streams: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Mixer, norm and attention projections: ``(x [T, D], q [T, n, d], kv [T, d], q_lora, post, comb)``.

        ``cos``/``sin`` ``[T, r/2]``: this layer's RoPE at the new positions.
        """
        x, post, comb = self.hc_attn(streams)
        x = self.attn_norm(x)
        return (x, *self.attn.project(x, cos, sin), post, comb)

    def attn_core(self, a: tuple[torch.Tensor, ...], step: "Step") -> tuple[torch.Tensor, ...]:
        """The attention core (window, compressor, indexer, softmax) on :meth:`attn_in`'s outputs:
        ``(attn [T, n, d], cos, sin, post, comb, ids)``, the inputs of the pieces after it."""
        x, q, kv, q_lora, post, comb = a
        out = self.attn.core(x, q, kv, q_lora, step.positions, step.start)
        return (out, *step.rope(self.attn), post, comb, step.ids)

    def ffn_in(self, streams: torch.Tensor, attn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               post: torch.Tensor, comb: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Attention output projection onto the streams, then the MoE's input, routing and shared partial.

        Args:
            attn: the attention core's ``[T, n, d]``. Returns ``(streams [T, m, D], shared [T, D],
            post, comb, x [T, D], index [T, K], weight [T, K])``: the carry, then the experts' inputs.
        """
        streams = expand(streams, self.attn.output(attn, cos, sin), post, comb)
        x, post, comb = self.hc_ffn(streams)
        x = self.ffn_norm(x)
        index, weight = self.ffn.route(x, ids)
        return streams, self.ffn.shared(x), post, comb, x, index, weight

    def ffn_out(self, streams: torch.Tensor, shared: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                x: torch.Tensor, weight: torch.Tensor, routed: torch.Tensor) -> tuple[torch.Tensor]:
        """The layer's one all-reduce (routed + shared partials) spread onto the streams: ``([T, m, D],)``
        (``x`` and ``weight`` are part of the common signature and not needed here)."""
        return (expand(streams, all_reduce(routed + shared), post, comb),)

    def ffn_block(self, streams: torch.Tensor, attn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  post: torch.Tensor, comb: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor]:
        """:meth:`ffn_in`, the routed experts, :meth:`ffn_out`: everything after the attention core."""
        streams, shared, post, comb, x, index, weight = self.ffn_in(streams, attn, cos, sin, post, comb, ids)
        return self.ffn_out(streams, shared, post, comb, x, weight, self.ffn.experts(x, index, weight))


@dataclass
class Step:
    """A one-token step's context for the layers' pieces: token ``ids [1]``, ``start``, ``positions [1]``
    and the RoPE ``(cos, sin)`` of each table, computed once per step (sliding layers share ``main``,
    compressed ones ``compress``)."""

    ids: torch.Tensor
    start: int
    positions: torch.Tensor
    tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def rope(self, attn: Attention) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of ``attn``'s table at the step's position."""
        table = "main" if attn.kind == "sliding" else "compress"
        if table not in self.tables:
            self.tables[table] = rope_cos_sin(self.positions, attn.freqs)
        return self.tables[table]


class DeepseekV4(nn.Module):
    """DeepSeek-V4 on one rank: vocab-parallel ``embed``, blocks, ``hc_head``, ``norm``, vocab-parallel ``head``.

    Args:
        args: configuration; shards: the rank's plan and compute dtype.

    Raises:
        RuntimeLoadError: the plan lacks a tensor the config needs (named).
    """

    def __init__(self, args: V4Args, shards: Shards) -> None:
        super().__init__()
        self.args = args
        freqs = {"main": inv_freq(args.rope_dim, args.rope_theta),
                 "compress": inv_freq(args.rope_dim, args.compress_theta, args.yarn)}
        self.embed = shards.embedding("embed.weight")
        self.layers = nn.ModuleList(Block(args, shards, i, freqs) for i in range(args.n_layers))
        self.hc_head = HyperHead(args.dim, args.hc_mult, args.hc_eps, args.norm_eps)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.head = shards.lm_head("head.weight")
        self.pos, self.max_seq_len = 0, 0

    @classmethod
    def from_weights(cls, weights, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                     max_seq_len: int = 4096) -> "DeepseekV4":
        """Build rank ``weights.rank``'s model from its weights (``config``, ``plan``, ``dense()``, ``banks()``).

        Raises:
            RuntimeLoadError: unsupported config, or missing/unexpected/mis-shaped tensors (all listed).
        """
        model = cls(V4Args.from_config(weights.config), Shards(weights.plan, weights.rank, dtype))
        assign_weights(model, weights.dense(), weights.banks(), device=torch.device(device))
        model.setup_cache(max_seq_len, torch.device(device), dtype)
        return model

    def setup_cache(self, max_seq_len: int, device: torch.device, dtype: torch.dtype) -> None:
        """Bound sequences to ``max_seq_len`` positions, move RoPE tables to ``device``, reset state."""
        self.max_seq_len = max_seq_len
        for mod in self.modules():
            if isinstance(getattr(mod, "freqs", None), torch.Tensor):
                mod.freqs = mod.freqs.to(device)
        self.reset()

    def reset(self) -> None:
        """Start a new sequence (position 0)."""
        self.pos = 0
        for layer in self.layers:
            layer.attn.reset()

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, *, last_only: bool = True) -> torch.Tensor:
        """Run ``ids`` ``[T]`` at positions ``[start, start + T)``; float32 logits ``[T or 1, V]``.

        Raises:
            UsageError: ``start`` is neither 0 nor the end of the previous step (the compressor
                state cannot rewind), or the sequence would pass ``max_seq_len``.
        """
        T = ids.shape[0]
        self._begin(start, T)
        (streams,) = self.embed_ids(ids)
        for layer in self.layers:
            streams = layer(streams, ids, start)
        self.pos = start + T
        return self.logits(streams[-1:] if last_only else streams)[0]  # [T or 1, V]

    def _begin(self, start: int, T: int) -> None:
        """Reset at ``start == 0``; refuse a step that does not continue the sequence or passes ``max_seq_len``."""
        if start == 0:
            self.reset()
        elif start != self.pos:
            raise UsageError(f"DeepSeek-V4 continues a sequence where it ended (position {self.pos}); "
                             f"got start={start} (its compressor state cannot rewind: restart at 0)")
        if self.max_seq_len and start + T > self.max_seq_len:
            raise UsageError(f"{start + T} positions exceed max_seq_len={self.max_seq_len}")

    @property
    def decode_layers(self) -> nn.ModuleList:
        """The blocks, whose pieces a decode step runs in order."""
        return self.layers

    def decode_step(self, ids: torch.Tensor, start: int) -> Step:
        """Begin a one-token step at ``start`` (checked and counted as :meth:`forward` does).

        Raises:
            UsageError: as :meth:`forward`.
        """
        self._begin(start, 1)
        self.pos = start + 1
        return Step(ids, start, torch.arange(start, start + 1, device=ids.device))

    def embed_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor]:
        """Token ids ``[T]`` -> ``([T, m, D],)``: the vocab-parallel embedding copied to every stream."""
        x = self.embed(ids)  # [T, D]
        return (x[:, None, :].expand(ids.shape[0], self.args.hc_mult, x.shape[-1]).contiguous(),)

    def logits(self, streams: torch.Tensor) -> tuple[torch.Tensor]:
        """Streams ``[T, m, D]`` -> ``([T, V] float32,)``: head mixer, final norm, vocab-parallel head."""
        return (self.head(self.norm(self.hc_head(streams))),)


def buffer_name(source: str, fp8_weights: set[str]) -> str:
    """The module buffer a source tensor fills (see the module docstring's table)."""
    if source.endswith(".scale") and source[: -len(".scale")] + ".weight" in fp8_weights:
        return source[: -len(".scale")] + ".weight_scale_inv"
    return _HC.sub(lambda m: f"{m.group(1)}hc_{m.group(2)}.{m.group(3)}", source)


def assign_weights(model: DeepseekV4, dense: dict[str, torch.Tensor], banks: dict[str, dict[str, torch.Tensor]],
                   *, device: torch.device) -> None:
    """Replace every ``meta`` buffer of ``model`` by the rank's tensor of the same name, strictly.

    FP8 weights and FP4/UE8M0 bank arrays keep their stored dtype (on CPU the buffer is the mmap
    view itself); FP8 block scales become float32; other tensors are cast to the buffer's dtype.

    Raises:
        RuntimeLoadError: listing every missing, unexpected, mis-shaped or wrongly typed tensor.
    """
    expected = dict(model.named_buffers())
    fp8 = {n for n, t in dense.items() if t.dtype == torch.float8_e4m3fn}
    given = {buffer_name(n, fp8): t for n, t in dense.items() if not n.startswith("mtp.")}
    for layer, arrays in banks.items():
        if not layer.startswith("mtp."):
            given.update({f"{layer}.ffn.experts.{a}": t for a, t in arrays.items()})

    def convert(name: str, t: torch.Tensor, meta: torch.Tensor) -> torch.Tensor | str:
        if meta.dtype in (torch.float8_e4m3fn, torch.int8, torch.float8_e8m0fnu, torch.int64) and t.dtype != meta.dtype:
            return f"dtype {t.dtype}, the model needs {meta.dtype}"
        if name.endswith(".weight_scale_inv"):
            return ue8m0_to_float(t).to(device)
        return t.to(device=device, dtype=meta.dtype)

    install_buffers(model, expected, given, convert, what="the rank's DeepSeek-V4 weights")
