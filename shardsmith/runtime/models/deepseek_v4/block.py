"""A DeepSeek-V4 decoder layer (:class:`Block`), and the context of a batched decode step (:class:`Step`).

A block is ``hc_attn`` -> attention -> ``hc_ffn`` -> MoE on ``m`` residual streams (transformers
``DeepseekV4DecoderLayer``). Besides its forward (one sequence, ``T`` tokens), it exposes the same
maths as the pieces of a decode step that :class:`~shardsmith.runtime.engine.cuda_graphs.DecodeGraphs`
runs (that module's table): ``attn_in`` and ``ffn_block`` / ``ffn_in`` / ``ffn_out`` are row-wise
(static shapes for a fixed ``B``), ``attn_core`` reads and appends to each row's own slot.

Legend: T = new tokens, B = rows of a batched decode step (one slot each), m = streams, D = hidden,
n = local heads, d = head dim, K = experts per token, r = rope dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardsmith.runtime.layers.experts import RoutedExperts
from shardsmith.runtime.layers.parallel import Shards, all_reduce
from shardsmith.runtime.models.deepseek_v4.attention import Attention
from shardsmith.runtime.models.deepseek_v4.config import V4Args
from shardsmith.runtime.models.deepseek_v4.hyper import HyperMixer, expand
from shardsmith.runtime.models.deepseek_v4.moe import MoE
from shardsmith.runtime.models.deepseek_v4.ops import RMSNorm
from shardsmith.runtime.models.deepseek_v4.rows import DecodeRows


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

    def forward(self, streams: torch.Tensor, ids: torch.Tensor, start: int, slot: int = 0) -> torch.Tensor:  # [T, m, D]
        x, post, comb = self.hc_attn(streams)
        streams = expand(streams, self.attn(self.attn_norm(x), start, slot), post, comb)
        x, post, comb = self.hc_ffn(streams)
        return expand(streams, self.ffn(self.ffn_norm(x), ids), post, comb)

    # The same layer as pieces around its attention, for a decode step run piece by piece
    # (engine/cuda_graphs.py's table): the same kernels in the same order as forward, so the same bits.

    @property
    def experts(self) -> RoutedExperts:
        """The routed experts."""
        return self.ffn.experts

    def attn_in_args(self, step: "Step") -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[B, r/2]``: this layer's RoPE table at each row's own position."""
        return step.rope(self.attn)

    def attn_in(self, streams: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Mixer, norm and attention projections: ``(x [T, D], q [T, n, d], kv [T, d], q_lora, *side, post,
        comb)`` (``side``: the compressors' and indexer's row-wise inputs, :meth:`Attention.project`).

        ``cos``/``sin`` ``[T, r/2]``: this layer's RoPE at the new positions.
        """
        x, post, comb = self.hc_attn(streams)
        x = self.attn_norm(x)
        return (x, *self.attn.project(x, cos, sin), post, comb)

    def attn_core(self, a: tuple[torch.Tensor, ...], step: "Step") -> tuple[torch.Tensor, ...]:
        """The attention core (window, compressor, indexer, softmax) on :meth:`attn_in`'s ``B`` rows:
        ``(attn [B, n, d], cos, sin, post, comb, ids)``, the inputs of the pieces after it.

        Rows ``< step.real`` attend over (and append to) their own slot's state; padding rows change
        no state and get a copy of row 0's output.
        """
        x, q, kv, q_lora, *side, post, comb = a
        n = step.real
        out = self.attn.decode_core(q[:n], kv[:n], [t[:n] for t in side], step.rows)
        if n < q.shape[0]:
            out = torch.cat((out, out[:1].expand(q.shape[0] - n, *out.shape[1:])))
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
    """A batched one-token step's context for the layers' pieces (row ``b``: slot ``slots[b]``'s token
    ``ids[b]`` at position ``starts[b]``; rows ``>= real`` are padding, copies of row 0).

    Attributes:
        ids: ``[B]`` token ids; starts / slots: ``B`` host ints; real: rows that are real sequences;
        rows: the step's device tensors (positions ``[B]``, the real rows' slots, masks and RoPE
        tables), each built once per step and shared by the layers (:class:`DecodeRows`).
    """

    ids: torch.Tensor
    starts: list[int]
    slots: list[int]
    real: int
    rows: DecodeRows

    @property
    def positions(self) -> torch.Tensor:
        """``[B]`` int64: ``starts`` on the device."""
        return self.rows.positions_all

    @property
    def index(self) -> torch.Tensor:
        """``[real]`` int64: the real rows' slots on the device."""
        return self.rows.index

    def rope(self, attn: Attention) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[B, r/2]`` of ``attn``'s table at each row's position (sliding layers share
        ``main``, compressed ones ``compress``)."""
        return self.rows.rope("main" if attn.kind == "sliding" else "compress", attn.freqs)
